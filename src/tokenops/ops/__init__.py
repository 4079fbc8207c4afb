"""Token operations: tenants and the API-key tree, limits, budgets by reservation, the metering
ledger, pricing, alerts and the runaway-agent breaker. The gateway talks only to
`tokenops.ops.service.Operations`; everything else in this package sits behind it."""
