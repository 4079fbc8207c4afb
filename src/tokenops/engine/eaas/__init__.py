"""Expert-as-a-Service: MoE experts as stateless servers that attention clients call.

`wire` is the binary frame format, `server` the expert server (`tokenops expert-server`),
`client` the routing table, dispatch and failover of the attention side, `placement` the
replication and packing of experts onto servers from measured loads. A monolithic MoE and an EaaS
deployment differ only in where `SparseMoeBlock.dispatch` sends the routed tokens.
"""
