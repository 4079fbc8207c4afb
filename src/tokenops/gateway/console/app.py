"""The console's pages and forms under `/console`, server-rendered with Jinja2.

Pages: usage (drillable down the key tree), budgets, fleet, keys and tenants. Every page needs a
session (session.py) opened by logging in with the admin key or a key with the `admin:read` scope;
forms that change state need the admin role and the session's CSRF token. Writes go through the
same ops façade as the admin API; the console adds no rule of its own.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import orjson
from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.applications import Starlette
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from tokenops.gateway.console import data
from tokenops.gateway.console.session import COOKIE, MAX_AGE_S, SessionCodec, cookie_header
from tokenops.ops.console_sessions import ConsoleSession
from tokenops.ops.keys import ADMIN_READ
from tokenops.protocol import APIError
from tokenops.token_types import TOKEN_TYPE_NAMES

if TYPE_CHECKING:
    from tokenops.gateway.app import Gateway

HERE = Path(__file__).parent
# the pages load only their own scripts and styles: no inline script, no third-party origin
SECURITY_HEADERS = {
    "content-security-policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; "
    "form-action 'self'; base-uri 'none'",
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
    "cache-control": "no-store",
}


def money(micros: int | float | None) -> str:
    if micros is None:
        return "-"
    return f"{micros / 1_000_000:,.6f}".rstrip("0").rstrip(".")


def number(n: int | float | None) -> str:
    return "-" if n is None else f"{n:,}"


def percent(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{100 * x:.1f}%"


def _environment() -> Environment:
    env = Environment(
        loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(["html"]), trim_blocks=True
    )
    env.filters.update(money=money, number=number, percent=percent)
    env.globals["token_types"] = TOKEN_TYPE_NAMES
    return env


def _micros(value: str) -> int:
    try:
        amount = float(value)
    except ValueError:
        raise APIError(
            400, f"A budget is an amount in currency units, got {value!r}.", param="budget"
        ) from None
    if not math.isfinite(amount) or amount < 0:
        raise APIError(400, f"A budget must be 0 or more, got {value!r}.", param="budget")
    return round(amount * 1_000_000)


def _whole(value: str, name: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise APIError(400, f"'{name}' must be a whole number, got {value!r}.", param=name) from None
    return n


def limits_from_form(form: FormData) -> dict[str, Any]:
    """The limit fields a form filled in (blank: not set), in the ops layer's names and units."""
    out: dict[str, Any] = {}
    for field in ("rpm", "tpm", "max_concurrent", "priority"):
        raw = str(form.get(field) or "").strip()
        if raw:
            out[field] = _whole(raw, field)  # the ops layer checks the range
    budget = str(form.get("budget") or "").strip()
    if budget:
        out["budget_micros"] = _micros(budget)
        period = str(form.get("budget_period") or "").strip()
        if period:
            out["budget_period"] = period
    alert = str(form.get("alert_threshold") or "").strip()
    if alert:
        try:
            out["alert_threshold"] = float(alert)
        except ValueError:
            raise APIError(
                400, f"'alert_threshold' is a fraction like 0.8, got {alert!r}.", param="alert_threshold"
            ) from None
    return out


def build_console_app(gateway: Gateway) -> Starlette:
    env = _environment()

    def codec() -> SessionCodec:
        # the admin key hashes sign the session: replicas sharing the admin key share sessions
        return SessionCodec("|".join(sorted(gateway.admin_auth.hashes)))

    def page(name: str, status: int = 200, headers: dict[str, str] | None = None, **ctx: Any) -> HTMLResponse:
        html = env.get_template(name).render(**ctx)
        return HTMLResponse(html, status_code=status, headers={**SECURITY_HEADERS, **(headers or {})})

    def login_page(request: Request, error: str | None = None, status: int = 200) -> HTMLResponse:
        enabled = gateway.admin_auth.configured
        return page("login.html", status, error=error, enabled=enabled, next=_next(request))

    def _next(request: Request) -> str:
        target = request.query_params.get("next") or "/console/usage"
        # only a path of this console: never an open redirect
        return target if target.startswith("/console/") and not target.startswith("//") else "/console/usage"

    async def current(request: Request) -> ConsoleSession | None:
        if not gateway.admin_auth.configured:
            return None
        session_id = codec().load(request.cookies.get(COOKIE))
        session = await gateway.ops.console_session(session_id) if session_id else None
        if session is None:  # never opened, logged out or expired
            return None
        if session.role == "read":
            info = await gateway.ops.get_key(session.key_id or "")
            if info is None or info.revoked_at is not None or ADMIN_READ not in info.scopes:
                return None
        return session

    def view(fn: Any) -> Any:
        """A page that needs a session: without one, the login form (then back here)."""

        async def handler(request: Request) -> Response:
            session = await current(request)
            if session is None:
                target = quote(request.url.path + (f"?{request.url.query}" if request.url.query else ""))
                return RedirectResponse(f"/console/login?next={target}", status_code=303)
            ctx = await fn(request, session)
            if isinstance(ctx, Response):
                return ctx
            name, values = ctx
            return page(name, session=session, active=name.removesuffix(".html"), **values)

        return handler

    def action(fn: Any) -> Any:
        """A form that changes state: needs an admin session and its CSRF token."""

        async def handler(request: Request) -> Response:
            session = await current(request)
            if session is None:
                return page(
                    "message.html", 401, title="Not logged in", message="Log in to the console first."
                )
            form = await request.form()
            if not codec().csrf_ok(session, str(form.get("csrf") or "")):
                return page(
                    "message.html",
                    403,
                    session=session,
                    title="Form expired",
                    message="The form's security token did not match this session. Reload and retry.",
                )
            if not session.can_write:
                return page(
                    "message.html",
                    403,
                    session=session,
                    title="Read-only access",
                    message="This session has read-only admin access: it cannot create, change or revoke.",
                )
            try:
                return await fn(request, session, form)
            except (APIError, ValueError, LookupError) as exc:
                if isinstance(exc, APIError):
                    status, message = exc.status, exc.message
                else:
                    status = 404 if isinstance(exc, LookupError) else 400
                    message = str(exc.args[0]) if exc.args else type(exc).__name__
                values = await data.keys_view(gateway)
                return page("keys.html", status, session=session, active="keys", error=message, **values)

        return handler

    async def login_form(request: Request) -> Response:
        return login_page(request)

    async def login(request: Request) -> Response:
        if not gateway.admin_auth.configured:
            return login_page(request, "The console is disabled: no admin key is configured.", 403)
        form = await request.form()
        key = str(form.get("key") or "").strip()
        if not key:
            return login_page(request, "Enter the admin key or a key with read-only admin access.", 400)
        if gateway.admin_auth.is_admin_key(key):
            session = await gateway.ops.open_console_session("admin", None, MAX_AGE_S)
        else:
            info = await gateway.ops.admin_reader(key)
            if info is None:
                return login_page(request, "That key is not an admin key or a read-only admin key.", 401)
            session = await gateway.ops.open_console_session("read", info.id, MAX_AGE_S)
        response = RedirectResponse(_next(request), status_code=303)
        response.headers["set-cookie"] = cookie_header(codec().dump(session))
        return response

    async def logout(request: Request) -> Response:
        session = await current(request)
        form = await request.form()
        if session is not None and not codec().csrf_ok(session, str(form.get("csrf") or "")):
            return page("message.html", 403, title="Form expired", message="Reload the page and retry.")
        if session is not None:
            await gateway.ops.close_console_session(session.id)  # the cookie is dead everywhere, copies too
        response = RedirectResponse("/console/login", status_code=303)
        response.headers["set-cookie"] = cookie_header("", max_age=0)
        return response

    async def home(request: Request) -> Response:
        return RedirectResponse("/console/usage", status_code=303)

    async def usage(request: Request, session: ConsoleSession) -> Any:
        bucket = request.query_params.get("bucket", "hour")
        if bucket not in data.BUCKETS:
            bucket = "hour"
        values = await data.usage_view(gateway, request.query_params.get("node"), bucket)
        values["chart_json"] = orjson.dumps(values["chart"]).decode()
        return "usage.html", values

    async def budgets(request: Request, session: ConsoleSession) -> Any:
        return "budgets.html", await data.budgets_view(gateway)

    async def fleet(request: Request, session: ConsoleSession) -> Any:
        return "fleet.html", await data.fleet_view(gateway)

    async def keys(request: Request, session: ConsoleSession) -> Any:
        return "keys.html", await data.keys_view(gateway)

    async def create_tenant(request: Request, session: ConsoleSession, form: FormData) -> Response:
        parent = data.split(str(form.get("parent") or ""))
        await gateway.ops.create_node(
            parent or None, str(form.get("name") or "").strip(), limits_from_form(form)
        )
        return RedirectResponse("/console/keys", status_code=303)

    async def update_limits(request: Request, session: ConsoleSession, form: FormData) -> Response:
        path = data.split(str(form.get("path") or ""))
        if not path:
            raise APIError(400, "Choose the node whose limits to change.", param="path")
        await gateway.ops.update_node(path, limits_from_form(form))
        return RedirectResponse("/console/keys", status_code=303)

    async def create_key(request: Request, session: ConsoleSession, form: FormData) -> Response:
        node = data.split(str(form.get("node") or ""))
        if not node:
            raise APIError(400, "Choose the tenant node the key belongs to.", param="node")
        scopes = [ADMIN_READ] if form.get("admin_read") else []
        plaintext, info = await gateway.ops.create_key(
            node, str(form.get("name") or "").strip(), limits_from_form(form), scopes
        )
        # the one time the key is shown: this response is never cached or redirected to
        return page("key_created.html", 201, session=session, active="keys", key=plaintext, info=info)

    async def revoke_key(request: Request, session: ConsoleSession, form: FormData) -> Response:
        await gateway.ops.revoke_key(request.path_params["key_id"])
        return RedirectResponse("/console/keys", status_code=303)

    async def not_found(request: Request, exc: Exception) -> Response:
        return page("message.html", 404, title="Not found", message=f"No console page at {request.url.path}.")

    async def not_allowed(request: Request, exc: Exception) -> Response:
        return page(
            "message.html", 405, title="Not allowed", message=f"{request.method} is not allowed here."
        )

    routes = [
        Route("/console", home, methods=["GET"]),
        Route("/console/", home, methods=["GET"]),
        Route("/console/login", login_form, methods=["GET"]),
        Route("/console/login", login, methods=["POST"]),
        Route("/console/logout", logout, methods=["POST"]),
        Route("/console/usage", view(usage), methods=["GET"]),
        Route("/console/budgets", view(budgets), methods=["GET"]),
        Route("/console/fleet", view(fleet), methods=["GET"]),
        Route("/console/keys", view(keys), methods=["GET"]),
        Route("/console/tenants", action(create_tenant), methods=["POST"]),
        Route("/console/tenants/limits", action(update_limits), methods=["POST"]),
        Route("/console/keys", action(create_key), methods=["POST"]),
        Route("/console/keys/{key_id}/revoke", action(revoke_key), methods=["POST"]),
        Mount("/console/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_allowed})
