"""What the console shows, read from the same sources as the admin API and `tokenops ops`: the ops
façade (usage reports from the ledger, node status, keys, the tenant tree), the cluster's status and
dispatch counters, and the gateway's metrics registry. Every read the console makes is here, so when
the ops API changes only this module follows it.

Each view is a plain dict for a template; money stays in micro-units until the template formats it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import func, select

from tokenops.ops import models as m
from tokenops.token_types import TOKEN_TYPE_NAMES

if TYPE_CHECKING:
    from tokenops.gateway.app import Gateway

BUCKETS = {"hour": timedelta(hours=1), "day": timedelta(days=1)}
# how far back each bucket size looks by default
WINDOWS = {"hour": timedelta(hours=48), "day": timedelta(days=60)}


def split(path: str | None) -> tuple[str, ...]:
    return tuple(p for p in (path or "").split("/") if p)


def _bucket_start(label: str, bucket: str) -> int:
    """Epoch seconds of a usage report's day ("YYYY-MM-DD") or hour ("YYYY-MM-DD HH") label (UTC)."""
    fmt = "%Y-%m-%d" if bucket == "day" else "%Y-%m-%d %H"
    return int(datetime.strptime(label, fmt).replace(tzinfo=UTC).timestamp())


async def usage_view(gw: Gateway, node: str | None, bucket: str) -> dict[str, Any]:
    """Usage under `node` (all tenants when empty): totals, one row per child of the node (the next
    level of the key tree; at a key, one row per model), and a series per token type over time."""
    ops = gw.ops
    path = split(node)
    under = "/".join(path) or None
    since = datetime.now(UTC) - WINDOWS[bucket]
    totals = await ops.usage([], since, None, under=under)
    by_node = await ops.usage(["node"], since, None, under=under)
    children: dict[str, dict[str, Any]] = {}
    leaf = False
    for row in by_node:
        parts = split(row["node"])
        if len(parts) == len(path):  # `node` is itself a key: break it down by model instead
            leaf = True
            continue
        child = "/".join(parts[: len(path) + 1])
        acc = children.setdefault(child, {"path": child, "name": parts[len(path)], "requests": 0})
        for k in ("requests", "cost_micros", "total_tokens", *TOKEN_TYPE_NAMES):
            acc[k] = acc.get(k, 0) + row[k]
    rows = sorted(children.values(), key=lambda r: r["path"])
    for r in rows:
        r["cost_per_million_tokens"] = r["cost_micros"] / r["total_tokens"] if r["total_tokens"] else 0.0
        r["drillable"] = True
    models = await ops.usage(["model"], since, None, under=under) if leaf or path else []
    series_rows = await ops.usage([bucket], since, None, under=under)
    step = int(BUCKETS[bucket].total_seconds())
    by_start = {_bucket_start(r[bucket], bucket): r for r in series_rows}
    # every bucket of the window, empty ones as zeros, so the chart's time axis is the window's
    first = int(since.timestamp()) // step * step
    xs = list(range(first, int(datetime.now(UTC).timestamp()) + 1, step))
    series = {
        name: [by_start[x][name] if x in by_start else 0 for x in xs]
        for name in (*TOKEN_TYPE_NAMES, "cost_micros")
    }
    return {
        "node": under or "",
        "crumbs": ["/".join(path[: i + 1]) for i in range(len(path))],
        "bucket": bucket,
        "since": since,
        "totals": totals[0] if totals else None,
        "rows": rows,
        "models": models,
        "chart": {"x": xs, "series": series, "token_types": list(TOKEN_TYPE_NAMES)},
    }


async def _alerts_fired(gw: Gateway) -> list[dict[str, Any]]:
    """Every recorded alert, newest first (the table `ledger.record_alert` writes): a budget level
    crossed, or a spend rate (value and limit are then the minute's spend and the rate crossed)."""
    a, n = m.alerts_sent, m.nodes

    def tx(conn):  # noqa: ANN001, ANN202
        q = (
            select(
                n.c.path,
                a.c.kind,
                a.c.level,
                a.c.period,
                a.c.fired_at,
                a.c.value_micros.label("spent_micros"),
                a.c.limit_micros.label("budget_micros"),
            )
            .join(n, n.c.id == a.c.node_id)
            .order_by(a.c.fired_at.desc())
            .limit(200)
        )
        return [dict(r._mapping) for r in conn.execute(q).all()]

    return await gw.ops.db.run(tx)


async def _reservations_in_flight(gw: Gateway) -> dict[int, int]:
    """Outstanding reservations (admissions not settled yet) per node id."""
    r = m.reservations

    def tx(conn):  # noqa: ANN001, ANN202
        q = select(r.c.node_id, func.count()).group_by(r.c.node_id)
        return {node_id: count for node_id, count in conn.execute(q).all()}

    return await gw.ops.db.run(tx)


async def budgets_view(gw: Gateway) -> dict[str, Any]:
    """Spent vs limit per budgeted node (tenants, projects and keys) in its current period."""
    ops = gw.ops
    in_flight = await _reservations_in_flight(gw)
    rows = []
    for node in await ops.list_nodes(kind=None):
        if node.settings.budget_micros is None:
            continue
        status = await ops.node_status(node.path)
        limit = node.settings.budget_micros
        spent, reserved = status.get("spent_micros", 0), status.get("reserved_micros", 0)
        rows.append(
            {
                "path": node.path,
                "kind": node.kind,
                "period": status.get("period"),
                "budget_micros": limit,
                "spent_micros": spent,
                "reserved_micros": reserved,
                "reservations": in_flight.get(node.id, 0),
                "used": min(1.0, spent / limit) if limit else 1.0,
                "held": min(1.0, (spent + reserved) / limit) if limit else 1.0,
                "alert_threshold": node.settings.alert_threshold,
            }
        )
    return {"rows": rows, "alerts": await _alerts_fired(gw)}


def _samples(gw: Gateway, prefix: str) -> list[Any]:
    """Samples of the gateway's own metrics whose name starts with `prefix` (what /metrics shows)."""
    return [s for fam in gw.metrics.registry.collect() for s in fam.samples if s.name.startswith(prefix)]


def _cache_view(gw: Gateway) -> dict[str, Any] | None:
    if gw.cache is None:
        return None
    lookups = sum(s.value for s in _samples(gw, "tokenops_cache_lookups_total"))
    hits: dict[str, float] = defaultdict(float)
    for s in _samples(gw, "tokenops_cache_hits_total"):
        hits[s.labels.get("layer", "")] += s.value
    false_hits = sum(s.value for s in _samples(gw, "tokenops_cache_false_hits_total"))
    total = sum(hits.values())
    return {
        "lookups": int(lookups),
        "hits": {k: int(v) for k, v in sorted(hits.items())},
        "hit_rate": total / lookups if lookups else 0.0,
        "false_hits": int(false_hits),
    }


async def fleet_view(gw: Gateway) -> dict[str, Any]:
    """Replicas per model with their load, KV usage, prefix-cache hit rate and breaker; degradations,
    fallbacks and sheds; the response cache's hit rates; each route's shares by serving model."""
    models = []
    for name, pool in gw.cluster.status().items():
        replicas = []
        for r in pool["replicas"]:
            rep = r["reported"] or {}
            queries = rep.get("prefix_cache_queries", 0)
            replicas.append(
                {
                    **r,
                    "running": rep.get("running"),
                    "waiting": rep.get("waiting"),
                    "kv_usage": rep.get("kv_usage"),
                    "prefix_hit_rate": rep.get("prefix_cache_hits", 0) / queries if queries else None,
                }
            )
        u = pool["utilisation"]
        models.append(
            {
                "name": name,
                "policy": pool["policy"],
                "utilisation": u if math.isfinite(u) else 1.0,
                "waiting": pool["waiting"],
                "replicas": replicas,
            }
        )
    counters = gw.cluster.counters
    degradations = [
        {"model": a, "served": b, "cause": c, "count": n} for (a, b, c), n in counters.degradations.items()
    ]
    fallbacks = [{"model": a, "served": b, "count": n} for (a, b), n in counters.fallbacks.items()]
    sheds = [{"model": a, "priority": p, "count": n} for (a, p), n in counters.sheds.items()]
    routes: dict[str, dict[str, Any]] = {}
    route_names = set(gw.settings.routes)
    if route_names:
        for row in await gw.ops.usage(["route", "model"]):
            if row["route"] not in route_names:
                continue
            r = routes.setdefault(row["route"], {"route": row["route"], "total": 0, "models": []})
            r["total"] += row["requests"]
            r["models"].append({"model": row["model"], "requests": row["requests"]})
        for r in routes.values():
            for mdl in r["models"]:
                mdl["share"] = mdl["requests"] / r["total"] if r["total"] else 0.0
    return {
        "models": models,
        "degradations": degradations,
        "fallbacks": fallbacks,
        "sheds": sheds,
        "cache": _cache_view(gw),
        "routes": sorted(routes.values(), key=lambda r: r["route"]),
    }


async def keys_view(gw: Gateway) -> dict[str, Any]:
    """The tenant tree with each node's limits, and every key (never its secret)."""
    nodes = await gw.ops.list_nodes()
    keys = await gw.ops.list_keys()
    return {"nodes": nodes, "keys": keys}
