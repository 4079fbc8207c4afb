"""The tenant tree: organisations, projects and deeper nodes, each with optional settings (allowed
models, RPM, TPM, max concurrent, budget and period, priority class, alert threshold, reasoning
budget cap, an agent session's history budget). A node is
addressed by its path ("acme/search"). Functions take an open connection and run inside the
caller's transaction. Keys live in `keys.py`; enforcement lives in limits/budgets."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, fields
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import bindparam, insert, select, update
from sqlalchemy.engine import Connection

from tokenops.ops import models as m
from tokenops.protocol import APIError, invalid_request

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
PERIODS = ("day", "month", "total")
# a history budget below this leaves no room for a summary and a recent turn
MIN_HISTORY_TOKENS = 64


@dataclass
class NodeSettings:
    """What a node may carry; `None` means "no limit of its own" (priority: inherited)."""

    allowed_models: list[str] | None = None
    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    budget_micros: int | None = None
    budget_period: str | None = None
    priority: int | None = None
    alert_threshold: float | None = None
    max_reasoning_tokens: int | None = None
    alert_thresholds: list[float] | None = None  # several soft alerts, e.g. [0.5, 0.8, 1.0]
    # a `/v1/responses` session is compacted once its next prompt would pass this many tokens
    max_history_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("rpm", "tpm", "max_concurrent"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise invalid_request(f"'{name}' must be a positive integer or null, got {v!r}.", param=name)
        if self.budget_micros is not None:
            if (
                not isinstance(self.budget_micros, int)
                or isinstance(self.budget_micros, bool)
                or self.budget_micros < 0
            ):
                raise invalid_request(
                    f"'budget_micros' must be an integer >= 0 (micro-units), got {self.budget_micros!r}.",
                    param="budget_micros",
                )
            if self.budget_period is None:
                self.budget_period = "month"
        if self.budget_period is not None and self.budget_period not in PERIODS:
            raise invalid_request(
                f"'budget_period' must be one of day, month, total; got {self.budget_period!r}.",
                param="budget_period",
            )
        if self.priority is not None and (not isinstance(self.priority, int) or not 0 <= self.priority <= 9):
            raise invalid_request(
                f"'priority' must be an integer 0 (highest) to 9, got {self.priority!r}.", param="priority"
            )
        if self.alert_threshold is not None and not (
            isinstance(self.alert_threshold, int | float) and 0 < self.alert_threshold <= 1
        ):
            raise invalid_request(
                f"'alert_threshold' must be a fraction in (0, 1], e.g. 0.8; got {self.alert_threshold!r}.",
                param="alert_threshold",
            )
        levels = self.alert_thresholds
        if levels is not None and not (
            isinstance(levels, list)
            and all(isinstance(x, int | float) and not isinstance(x, bool) and 0 < x <= 1 for x in levels)
        ):
            raise invalid_request(
                "'alert_thresholds' must be a list of fractions in (0, 1], e.g. [0.5, 0.8, 1]; "
                f"got {levels!r}.",
                param="alert_thresholds",
            )
        v = self.max_reasoning_tokens
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise invalid_request(
                f"'max_reasoning_tokens' must be an integer >= 0 (0 = no thinking) or null, got {v!r}.",
                param="max_reasoning_tokens",
            )
        v = self.max_history_tokens
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < MIN_HISTORY_TOKENS):
            raise invalid_request(
                f"'max_history_tokens' must be an integer >= {MIN_HISTORY_TOKENS} or null, got {v!r}.",
                param="max_history_tokens",
            )
        if self.allowed_models is not None and (
            not isinstance(self.allowed_models, list)
            or not all(isinstance(x, str) and x for x in self.allowed_models)
        ):
            raise invalid_request(
                "'allowed_models' must be a list of model names or null.", param="allowed_models"
            )

    def alert_levels(self) -> list[float]:
        """Every soft-alert threshold of this node, lowest first (alert_threshold is one of them)."""
        levels = {float(x) for x in self.alert_thresholds or ()}
        if self.alert_threshold is not None:
            levels.add(float(self.alert_threshold))
        return sorted(levels)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> NodeSettings:
        data = dict(data or {})
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise invalid_request(
                f"Unknown node setting(s): {', '.join(sorted(unknown))}. Known: {', '.join(sorted(known))}.",
                param=sorted(unknown)[0],
            )
        return cls(**data)

    def as_columns(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Node:
    id: int
    parent_id: int | None
    name: str
    path: str
    kind: str
    settings: NodeSettings

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "path": self.path,
            "name": self.name,
            "kind": self.kind,
            **self.settings.as_columns(),
        }


_SETTING_COLUMNS = tuple(f.name for f in fields(NodeSettings))


def _row_to_node(row: Any) -> Node:
    return Node(
        id=row.id,
        parent_id=row.parent_id,
        name=row.name,
        path=row.path,
        kind=row.kind,
        settings=NodeSettings(**{c: getattr(row, c) for c in _SETTING_COLUMNS}),
    )


def _smallest(nodes: list[Node], setting: str) -> int | None:
    """The smallest value of a cap-like setting on the path (a project may lower its organisation's,
    never raise it); None when no node sets it."""
    values = [v for n in nodes if (v := getattr(n.settings, setting)) is not None]
    return min(values) if values else None


def reasoning_cap(nodes: list[Node]) -> int | None:
    """The thinking budget a request on this path may use at most."""
    return _smallest(nodes, "max_reasoning_tokens")


def history_budget(nodes: list[Node]) -> int | None:
    """The prompt budget past which an agent session on this path is compacted."""
    return _smallest(nodes, "max_history_tokens")


def check_name(name: str, what: str = "node") -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise invalid_request(
            f"Invalid {what} name {name!r}: use 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit.",
            param="name",
        )
    return name


def split_path(path: str | tuple[str, ...] | list[str] | None) -> tuple[str, ...]:
    if path is None or path == "":
        return ()
    parts = tuple(path.strip("/").split("/")) if isinstance(path, str) else tuple(path)
    for p in parts:
        check_name(p)
    return parts


def ancestor_paths(path: str) -> list[str]:
    parts = path.split("/")
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


def get_node(conn: Connection, path: str | tuple[str, ...]) -> Node:
    p = "/".join(split_path(path))
    row = conn.execute(select(m.nodes).where(m.nodes.c.path == p)).first()
    if row is None:
        raise APIError(
            404, f"No tenant node '{p}'. Create it first (tokenops tenants create).", code="node_not_found"
        )
    return _row_to_node(row)


_LOAD_PATH = select(m.nodes).where(m.nodes.c.path.in_(bindparam("paths", expanding=True)))


def load_path(conn: Connection, path: str) -> list[Node]:
    """Every node from the root down to `path`, root first (one query)."""
    rows = conn.execute(_LOAD_PATH, {"paths": ancestor_paths(path)}).all()
    nodes = sorted((_row_to_node(r) for r in rows), key=lambda n: n.path.count("/"))
    return nodes


def create_node(
    conn: Connection,
    parent_path: str | tuple[str, ...] | None,
    name: str,
    settings: NodeSettings,
    kind: str = "node",
) -> Node:
    check_name(name)
    parent = split_path(parent_path)
    parent_id = get_node(conn, parent).id if parent else None
    path = "/".join((*parent, name))
    if conn.execute(select(m.nodes.c.id).where(m.nodes.c.path == path)).first() is not None:
        raise APIError(409, f"A node named '{path}' already exists.", code="node_exists", param="name")
    now = datetime.now(UTC)
    node_id = conn.execute(
        insert(m.nodes)
        .values(
            parent_id=parent_id,
            name=name,
            path=path,
            kind=kind,
            created_at=now,
            updated_at=now,
            **settings.as_columns(),
        )
        .returning(m.nodes.c.id)
    ).scalar_one()
    return Node(node_id, parent_id, name, path, kind, settings)


def update_node(conn: Connection, path: str | tuple[str, ...], changes: dict[str, Any]) -> Node:
    """Set the given settings (a null value clears one); others are left as they are."""
    node = get_node(conn, path)
    merged = {**node.settings.as_columns(), **changes}
    settings = NodeSettings.from_dict(merged)
    conn.execute(
        update(m.nodes)
        .where(m.nodes.c.id == node.id)
        .values(updated_at=datetime.now(UTC), **settings.as_columns())
    )
    node.settings = settings
    return node


def list_nodes(conn: Connection, kind: str | None = "node") -> list[Node]:
    q = select(m.nodes).order_by(m.nodes.c.path)
    if kind is not None:
        q = q.where(m.nodes.c.kind == kind)
    return [_row_to_node(r) for r in conn.execute(q).all()]
