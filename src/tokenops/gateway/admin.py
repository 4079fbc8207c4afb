"""The admin HTTP API under `/admin/`, a thin layer over the ops façade, behind the admin key.

Endpoints (JSON in, JSON out, OpenAI-format errors):
- `GET /admin/tenants`: every node of the tenant tree; `POST /admin/tenants` `{"parent": "org/project"
  or null, "name", "limits": {...}}`; `PATCH /admin/tenants/{path}` `{"limits": {...}}`.
- `GET /admin/keys`; `POST /admin/keys` `{"node": "org/project", "name", "limits": {...}, "scopes":
  ["admin:read"]}` returns the key's plaintext once; `DELETE /admin/keys/{key_id}` (or `POST
  /admin/keys/{key_id}/revoke`).
- `GET /admin/usage?group_by=tenant,model&since=ISO&until=ISO&under=org/project`.
- `POST /admin/cache/false-hits` `{"hit_id"}`: a served cache hit was wrong; drop its entry (counted).
- `GET /admin/cluster`: per model and replica, breaker state, weight, concurrency limit, in flight.

This module owns admin authentication (the admin key from the config and/or the hashes `tokenops
serve` generated, compared in constant time; for GET, also an API key with the read-only admin
scope) and the HTTP shape of these operations. The rules (what a limit means, how a key is stored)
belong to the ops layer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
from datetime import datetime
from typing import TYPE_CHECKING, Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tokenops.ops.usage import GROUPS
from tokenops.protocol import APIError, invalid_request

if TYPE_CHECKING:
    from tokenops.gateway.app import Gateway


def hash_admin_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class AdminAuth:
    """Accepts the configured admin key and any key whose sha256 is among `hashes`."""

    def __init__(self, plain: str | None, hashes: tuple[str, ...] = ()) -> None:
        self._hashes = tuple(hashes) + ((hash_admin_key(plain),) if plain else ())

    @property
    def hashes(self) -> tuple[str, ...]:
        return self._hashes

    @property
    def configured(self) -> bool:
        return bool(self._hashes)

    def is_admin_key(self, token: str) -> bool:
        digest = hash_admin_key(token)
        return any(hmac.compare_digest(digest, h) for h in self._hashes)

    def check(self, request: Request) -> None:
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        token = token.strip() if scheme.lower() == "bearer" else ""
        if not self._hashes:
            raise APIError(
                403,
                "The admin API is disabled: no admin key is configured. Set admin_key in the config "
                "(or TOKENOPS_ADMIN_KEY), or start with `tokenops serve`, which creates one.",
                type="permission_error",
                code="admin_disabled",
            )
        if not token:
            raise APIError(
                401,
                "Missing admin key. Send it as 'Authorization: Bearer <admin key>'.",
                type="authentication_error",
                code="missing_admin_key",
            )
        if not self.is_admin_key(token):
            raise APIError(
                401, "The admin key is not valid.", type="authentication_error", code="invalid_admin_key"
            )


def _default(obj: Any) -> Any:
    if isinstance(obj, tuple | set | frozenset):
        return list(obj)
    raise TypeError


def _dump(obj: Any) -> Any:
    """Plain JSON-able data from ops' return values (dataclasses, pydantic models, mappings)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _dump(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if hasattr(obj, "model_dump"):
        return obj.model_dump(mode="json")
    if hasattr(obj, "_asdict"):
        return _dump(obj._asdict())
    if hasattr(obj, "_mapping"):
        return _dump(dict(obj._mapping))
    if isinstance(obj, dict):
        return {str(k): _dump(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_dump(v) for v in obj]
    if isinstance(obj, datetime):
        return obj.isoformat()
    return obj


def _json(obj: Any, status: int = 200) -> Response:
    return Response(
        orjson.dumps(_dump(obj), default=_default), status_code=status, media_type="application/json"
    )


def _error(err: APIError) -> Response:
    return Response(
        orjson.dumps(err.body()), status_code=err.status, media_type="application/json", headers=err.headers
    )


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw:
        return {}
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise invalid_request("The request body is not valid JSON.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.", code="invalid_json")
    return body


def _path(value: Any, field: str) -> tuple[str, ...]:
    if value is None or value == "":
        return ()
    if isinstance(value, str):
        return tuple(p for p in value.split("/") if p)
    if isinstance(value, list) and all(isinstance(p, str) for p in value):
        return tuple(value)
    raise invalid_request(f"'{field}' must be a path like 'org/project' or a list of names.", param=field)


def _name(body: dict[str, Any]) -> str:
    name = body.get("name")
    if not isinstance(name, str) or not name or "/" in name:
        raise invalid_request("'name' must be a non-empty string without '/'.", param="name")
    return name


def _limits(body: dict[str, Any]) -> dict[str, Any]:
    limits = body.get("limits") or {}
    if not isinstance(limits, dict):
        raise invalid_request("'limits' must be an object.", param="limits")
    return limits


def _time(value: str | None, field: str) -> datetime | None:
    if not value:
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        raise invalid_request(
            f"'{field}' must be an ISO 8601 date or time, got {value!r}.", param=field
        ) from None


def build_admin_app(gateway: Gateway) -> Starlette:
    async def authorise(request: Request) -> None:
        try:
            gateway.admin_auth.check(request)
        except APIError as err:
            if err.code != "invalid_admin_key":
                raise
            token = request.headers.get("authorization", "").partition(" ")[2].strip()
            if await gateway.ops.admin_reader(token) is None:
                raise
            if request.method != "GET":
                raise APIError(
                    403,
                    "This key has read-only admin access: it can read the admin API but not change it.",
                    type="permission_error",
                    code="read_only_admin",
                ) from None

    def endpoint(fn: Any) -> Any:
        async def handler(request: Request) -> Response:
            try:
                await authorise(request)
                return await fn(request)
            except APIError as err:
                return _error(err)
            except (ValueError, KeyError, LookupError) as exc:
                # the ops layer names what is wrong (unknown node, duplicate name, bad limit)
                status = (
                    404
                    if isinstance(exc, KeyError | LookupError) and not isinstance(exc, ValueError)
                    else 400
                )
                msg = str(exc.args[0]) if exc.args else type(exc).__name__
                return _error(APIError(status, msg, code="not_found" if status == 404 else "invalid_value"))

        return handler

    ops = lambda: gateway.ops  # noqa: E731  (the façade is opened at startup, after this app is built)

    async def list_tenants(request: Request) -> Response:
        return _json({"object": "list", "data": await ops().list_nodes()})

    async def create_tenant(request: Request) -> Response:
        body = await _body(request)
        node = await ops().create_node(_path(body.get("parent"), "parent"), _name(body), _limits(body))
        return _json(node, 201)

    async def update_tenant(request: Request) -> Response:
        body = await _body(request)
        node = await ops().update_node(_path(request.path_params["path"], "path"), _limits(body))
        return _json(node)

    async def list_keys(request: Request) -> Response:
        return _json({"object": "list", "data": await ops().list_keys()})

    async def create_key(request: Request) -> Response:
        body = await _body(request)
        node = _path(body.get("node"), "node")
        if not node:
            raise invalid_request(
                "'node' names the tenant node the key belongs to, e.g. 'acme/web'.", param="node"
            )
        scopes = body.get("scopes") or []
        if not isinstance(scopes, list):
            raise invalid_request("'scopes' must be a list, e.g. [\"admin:read\"].", param="scopes")
        plaintext, info = await ops().create_key(node, _name(body), _limits(body), scopes)
        return _json({"key": plaintext, "info": info}, 201)

    async def revoke_key(request: Request) -> Response:
        key_id = request.path_params["key_id"]
        await ops().revoke_key(key_id)
        return _json({"id": key_id, "revoked": True})

    async def usage(request: Request) -> Response:
        q = request.query_params
        group_by = [g for g in (q.get("group_by") or "tenant").split(",") if g]
        bad = [g for g in group_by if g not in GROUPS]
        if bad:
            raise invalid_request(
                f"group_by accepts {', '.join(GROUPS)}; got {', '.join(bad)}.", param="group_by"
            )
        rows = await ops().usage(
            group_by,
            _time(q.get("since"), "since"),
            _time(q.get("until"), "until"),
            under=q.get("under") or None,
        )
        return _json({"object": "list", "group_by": group_by, "data": rows})

    async def cache_false_hit(request: Request) -> Response:
        body = await _body(request)
        hit_id = body.get("hit_id")
        if not isinstance(hit_id, str) or not hit_id:
            raise invalid_request(
                "'hit_id' is the x-tokenops-cache-id header of the wrong answer.", param="hit_id"
            )
        cache = gateway.cache
        if cache is None:
            raise APIError(
                409, "The response cache is disabled (cache.enabled: false).", code="cache_disabled"
            )
        if not await cache.report_false_hit(hit_id, tenant=None):
            raise APIError(
                404,
                f"No cached entry for hit id '{hit_id}' (unknown, expired or already dropped).",
                code="not_found",
            )
        return _json({"hit_id": hit_id, "dropped": True})

    async def cluster_status(request: Request) -> Response:
        return _json({"object": "cluster", "models": gateway.cluster.status()})

    async def admission_status(request: Request) -> Response:
        return _json({"object": "admission", "lines": gateway.gate.state()})

    async def alerts_fired(request: Request) -> Response:
        return _json({"object": "list", "data": [_dump(a) for a in reversed(gateway.ops.alerts.sent)]})

    routes = [
        Route("/admin/admission", endpoint(admission_status), methods=["GET"]),
        Route("/admin/alerts", endpoint(alerts_fired), methods=["GET"]),
        Route("/admin/cache/false-hits", endpoint(cache_false_hit), methods=["POST"]),
        Route("/admin/cluster", endpoint(cluster_status), methods=["GET"]),
        Route("/admin/tenants", endpoint(list_tenants), methods=["GET"]),
        Route("/admin/tenants", endpoint(create_tenant), methods=["POST"]),
        Route("/admin/tenants/{path:path}", endpoint(update_tenant), methods=["PATCH"]),
        Route("/admin/keys", endpoint(list_keys), methods=["GET"]),
        Route("/admin/keys", endpoint(create_key), methods=["POST"]),
        Route("/admin/keys/{key_id}", endpoint(revoke_key), methods=["DELETE"]),
        Route("/admin/keys/{key_id}/revoke", endpoint(revoke_key), methods=["POST"]),
        Route("/admin/usage", endpoint(usage), methods=["GET"]),
    ]

    async def not_found(request: Request, exc: Exception) -> Response:
        return _error(APIError(404, f"Unknown admin path '{request.url.path}'.", code="unknown_url"))

    async def not_allowed(request: Request, exc: Exception) -> Response:
        return _error(
            APIError(
                405, f"{request.method} is not allowed on '{request.url.path}'.", code="method_not_allowed"
            )
        )

    return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_allowed})
