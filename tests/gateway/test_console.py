"""The console over HTTP against a real gateway on loopback: the session cookie's attributes and
signature, pages behind the login, CSRF on every form that changes state, the read-only admin scope
(console and admin API), forms that create and revoke, and bad form input answered with a message.
The browser-driven checks are in test_console_browser.py."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import sqlalchemy as sa
from gateway_harness import ADMIN_KEY, MODEL, RunningGateway, gateway_settings, start_gateway

PROMPT = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def gw(stub: tuple[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    gateway = start_gateway(gateway_settings(stub[0], tmp_path_factory.mktemp("console")))
    yield gateway
    gateway.stop()


@pytest.fixture()
def http(gw: RunningGateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gw.url, follow_redirects=False, timeout=30) as client:
        yield client


def log_in(http: httpx.Client, key: str) -> dict[str, str]:
    """The cookie header of a fresh session (httpx keeps Secure cookies for https only)."""
    r = http.post("/console/login", data={"key": key})
    assert r.status_code == 303, r.text
    return {"cookie": r.headers["set-cookie"].split(";")[0]}


def csrf(http: httpx.Client, cookie: dict[str, str]) -> str:
    page = http.get("/console/keys", headers=cookie)
    assert page.status_code == 200
    return re.search(r'name="csrf" value="([^"]+)"', page.text).group(1)


def field(html: str, name: str) -> str:
    return re.search(rf'data-field="{name}">([^<]*)<', html).group(1)


def test_login_sets_a_signed_secure_httponly_strict_cookie(http: httpx.Client) -> None:
    r = http.post("/console/login", data={"key": ADMIN_KEY})
    assert r.status_code == 303 and r.headers["location"] == "/console/usage"
    attrs = [a.strip() for a in r.headers["set-cookie"].split(";")]
    assert {"Secure", "HttpOnly", "SameSite=Strict", "Path=/console"} <= set(attrs)
    assert ADMIN_KEY not in r.headers["set-cookie"]  # the cookie names a role, never the key
    cookie = attrs[0]
    assert http.get("/console/usage", headers={"cookie": cookie}).status_code == 200
    name, _, value = cookie.partition("=")
    forged = value[:-3] + ("AAA" if value[-3:] != "AAA" else "BBB")
    r = http.get("/console/usage", headers={"cookie": f"{name}={forged}"})
    assert r.status_code == 303 and r.headers["location"].startswith("/console/login")


def test_pages_without_a_session_go_to_the_login(http: httpx.Client) -> None:
    for path in ("/console/usage", "/console/budgets", "/console/fleet", "/console/keys"):
        r = http.get(path)
        assert r.status_code == 303 and r.headers["location"].startswith("/console/login?next=")
    assert http.post("/console/keys", data={"name": "x"}).status_code == 401


def test_keys_that_are_not_admin_do_not_log_in(gw: RunningGateway, http: httpx.Client) -> None:
    plain = gw.new_key("plain")
    for key, status in (("", 400), ("tok-wrong", 401), (plain, 401)):
        r = http.post("/console/login", data={"key": key})
        assert r.status_code == status and "set-cookie" not in r.headers
        assert 'data-testid="error"' in r.text


def test_a_login_never_redirects_off_the_console(http: httpx.Client) -> None:
    for target in ("https://evil.example/", "//evil.example/", "/admin/keys"):
        r = http.post("/console/login", params={"next": target}, data={"key": ADMIN_KEY})
        assert r.headers["location"] == "/console/usage"


def test_usage_page_shows_the_ledger_totals(gw: RunningGateway, http: httpx.Client) -> None:
    key = gw.new_key("usage", org="u-org", project="u-proj")
    for _ in range(3):
        gw.client(key).chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=8)
    rows = gw.wait_ledger(3, node_path="u-org/u-proj/usage")
    html = http.get("/console/usage", params={"node": "u-org"}, headers=log_in(http, ADMIN_KEY)).text
    totals = html[html.index('data-testid="totals"') :]
    assert field(totals, "requests") == "3"
    assert int(field(totals, "output").replace(",", "")) == sum(r["output_tokens"] for r in rows)
    assert round(float(field(totals, "cost")) * 1e6) == sum(r["cost_micros"] for r in rows)
    assert 'data-node="u-org/u-proj"' in html  # the next level of the tree, drillable


def test_every_state_change_needs_the_csrf_token(gw: RunningGateway, http: httpx.Client) -> None:
    cookie = log_in(http, ADMIN_KEY)
    before = len(gw.admin("GET", "/admin/keys").json()["data"])
    for token in (None, "not-the-token"):
        form = {"node": "org/proj", "name": "csrf-less"} | ({"csrf": token} if token else {})
        r = http.post("/console/keys", data=form, headers=cookie)
        assert r.status_code == 403
    assert len(gw.admin("GET", "/admin/keys").json()["data"]) == before
    other = log_in(http, ADMIN_KEY)  # another session's token is not this one's
    r = http.post(
        "/console/keys", data={"node": "org", "name": "x", "csrf": csrf(http, other)}, headers=cookie
    )
    assert r.status_code == 403


def test_create_limit_and_revoke_through_the_forms(gw: RunningGateway, http: httpx.Client) -> None:
    cookie = log_in(http, ADMIN_KEY)
    token = csrf(http, cookie)
    r = http.post(
        "/console/tenants",
        data={"csrf": token, "parent": "", "name": "formco", "budget": "2.5"},
        headers=cookie,
    )
    assert r.status_code == 303
    r = http.post(
        "/console/tenants/limits", data={"csrf": token, "path": "formco", "rpm": "120"}, headers=cookie
    )
    assert r.status_code == 303
    nodes = {n["path"]: n for n in gw.admin("GET", "/admin/tenants").json()["data"]}
    limits = nodes["formco"]["settings"]
    assert limits["budget_micros"] == 2_500_000 and limits["rpm"] == 120
    r = http.post("/console/keys", data={"csrf": token, "node": "formco", "name": "k"}, headers=cookie)
    assert r.status_code == 201 and r.headers["cache-control"] == "no-store"
    key = re.search(r'data-testid="new-key">([^<]+)<', r.text).group(1)
    key_id = re.search(r'data-testid="key-id">([^<]+)<', r.text).group(1)
    assert gw.client(key).chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=4).choices
    assert key not in http.get("/console/keys", headers=cookie).text  # shown once
    r = http.post(f"/console/keys/{key_id}/revoke", data={"csrf": token}, headers=cookie)
    assert r.status_code == 303
    with pytest.raises(openai.AuthenticationError):
        gw.client(key).chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=4)


@pytest.mark.parametrize(
    ("form", "status", "says"),
    [
        ({"parent": "", "name": "bad", "budget": "lots"}, 400, "currency units"),
        ({"parent": "", "name": "bad", "rpm": "-3"}, 400, "rpm"),
        ({"parent": "", "name": "bad", "rpm": "many"}, 400, "whole number"),
        ({"parent": "no-such-node", "name": "child"}, 404, "no-such-node"),
        ({"parent": "", "name": "bad/name"}, 400, "name"),
    ],
)
def test_bad_form_input_gets_a_message_not_a_500(
    http: httpx.Client, form: dict[str, str], status: int, says: str
) -> None:
    cookie = log_in(http, ADMIN_KEY)
    r = http.post("/console/tenants", data={"csrf": csrf(http, cookie), **form}, headers=cookie)
    assert r.status_code == status, r.text
    assert says in re.search(r'data-testid="error">([^<]+)<', r.text).group(1)


def test_revoking_an_unknown_key_is_a_404_page(http: httpx.Client) -> None:
    cookie = log_in(http, ADMIN_KEY)
    r = http.post("/console/keys/key_nope/revoke", data={"csrf": csrf(http, cookie)}, headers=cookie)
    assert r.status_code == 404 and "key_nope" in r.text


def test_the_read_only_scope_reads_but_never_writes(gw: RunningGateway, http: httpx.Client) -> None:
    gw.new_key("seed", org="ro", project="p")
    r = gw.admin("POST", "/admin/keys", json={"node": "ro", "name": "auditor", "scopes": ["admin:read"]})
    assert r.status_code == 201 and r.json()["info"]["scopes"] == ["admin:read"]
    reader, reader_id = r.json()["key"], r.json()["info"]["id"]
    cookie = log_in(http, reader)
    for path in ("/console/usage", "/console/budgets", "/console/fleet", "/console/keys"):
        page = http.get(path, headers=cookie)
        assert page.status_code == 200 and "read-only admin" in page.text
    token = csrf(http, cookie)
    victim = next(k["id"] for k in gw.admin("GET", "/admin/keys").json()["data"] if k["revoked_at"] is None)
    for path, form in (
        ("/console/keys", {"node": "ro", "name": "sneaky"}),
        ("/console/tenants", {"parent": "", "name": "sneaky"}),
        (f"/console/keys/{victim}/revoke", {}),
    ):
        assert http.post(path, data={"csrf": token, **form}, headers=cookie).status_code == 403
    assert all(
        k["revoked_at"] is None for k in gw.admin("GET", "/admin/keys").json()["data"] if k["id"] == victim
    )
    # the admin API: reads yes, writes no
    bearer = {"authorization": f"Bearer {reader}"}
    assert http.get("/admin/usage", headers=bearer).status_code == 200
    r = http.post("/admin/tenants", json={"parent": None, "name": "sneaky"}, headers=bearer)
    assert r.status_code == 403 and r.json()["error"]["code"] == "read_only_admin"
    # revoking the reader ends its console session at once
    gw.admin("DELETE", f"/admin/keys/{reader_id}")
    assert http.get("/console/usage", headers=cookie).status_code == 303
    assert http.get("/admin/usage", headers=bearer).status_code == 401


@pytest.mark.parametrize("scopes", [["root"], [{}], "admin:read", [1]])
def test_an_unknown_scope_is_a_400(gw: RunningGateway, scopes: Any) -> None:
    gw.admin("POST", "/admin/tenants", json={"parent": None, "name": "s-org"})  # 409 after the first
    r = gw.admin("POST", "/admin/keys", json={"node": "s-org", "name": "x", "scopes": scopes})
    assert r.status_code == 400 and r.json()["error"]["param"] == "scopes"


def test_budgets_and_fleet_pages_show_live_state(gw: RunningGateway, http: httpx.Client) -> None:
    key = gw.new_key("budgeted", {"budget_micros": 1_000_000}, org="b-org", project="b-proj")
    gw.client(key).chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=8)
    spent = sum(r["cost_micros"] for r in gw.wait_ledger(1, node_path="b-org/b-proj/budgeted"))
    cookie = log_in(http, ADMIN_KEY)
    html = http.get("/console/budgets", headers=cookie).text
    row = html[html.index('data-node="b-org/b-proj/budgeted"') :]
    assert round(float(field(row, "spent")) * 1e6) == spent and field(row, "limit") == "1"
    fleet = http.get("/console/fleet", headers=cookie).text
    assert f'data-model="{MODEL}"' in fleet and "data-replica=" in fleet


def test_the_vendored_chart_library_is_served_offline(http: httpx.Client) -> None:
    r = http.get("/console/static/vendor/uPlot.iife.min.js")
    assert r.status_code == 200 and "uPlot" in r.text[:2000]
    page = http.get("/console/login")
    assert page.headers["content-security-policy"].startswith("default-src 'self'")
    assert not re.search(r'(src|href)="https?://', page.text)  # no CDN, no third-party origin


@pytest.mark.postgres
def test_usage_budgets_and_alerts_pages_on_postgresql(stub: tuple[str, Any], tmp_path: Any) -> None:
    pg = "postgresql://postgres@127.0.0.1:5432/test"
    schema = f"t_console_{uuid.uuid4().hex[:12]}"
    gateway = start_gateway(gateway_settings(stub[0], tmp_path, database_url=pg, database_schema=schema))
    try:
        key = gateway.new_key("pg", {"budget_micros": 1_000, "alert_threshold": 0.01}, org="pg-org")
        for _ in range(2):
            gateway.client(key).chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=8)
        rows = gateway.wait_ledger(2)
        with httpx.Client(base_url=gateway.url, timeout=30) as http:
            cookie = log_in(http, ADMIN_KEY)
            for bucket in ("hour", "day"):
                html = http.get(
                    "/console/usage", params={"node": "pg-org", "bucket": bucket}, headers=cookie
                ).text
                assert field(html[html.index('data-testid="totals"') :], "requests") == "2"
                assert round(float(field(html, "cost")) * 1e6) == sum(r["cost_micros"] for r in rows)
            html = http.get("/console/budgets", headers=cookie).text
            assert 'data-testid="alerts"' in html and html.count('data-node="pg-org/proj/pg"') == 2
    finally:
        gateway.stop()
        engine = sa.create_engine(pg.replace("postgresql://", "postgresql+psycopg://"))
        with engine.begin() as conn:
            conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        engine.dispose()


def test_logout_ends_the_session_on_the_server_and_needs_the_token(
    gw: RunningGateway, http: httpx.Client
) -> None:
    cookie = log_in(http, ADMIN_KEY)
    other = log_in(http, ADMIN_KEY)  # another browser's session of the same admin
    assert http.post("/console/logout", data={"csrf": "wrong"}, headers=cookie).status_code == 403
    assert http.get("/console/usage", headers=cookie).status_code == 200  # a refused logout ends nothing
    r = http.post("/console/logout", data={"csrf": csrf(http, cookie)}, headers=cookie)
    assert r.status_code == 303 and r.headers["location"] == "/console/login"
    assert "Max-Age=0" in r.headers["set-cookie"] and r.headers["set-cookie"].startswith("tokenops_console=;")
    # the old cookie, replayed as a copy would be, no longer opens a page nor submits a form
    r = http.get("/console/usage", headers=cookie)
    assert r.status_code == 303 and r.headers["location"].startswith("/console/login")
    assert http.post("/console/keys", data={"name": "x"}, headers=cookie).status_code == 401
    assert http.get("/console/usage", headers=other).status_code == 200  # only that session ended
    # a read-only session logs out the same way
    gw.new_key("seed", org="lo", project="p")
    r = gw.admin("POST", "/admin/keys", json={"node": "lo", "name": "auditor", "scopes": ["admin:read"]})
    assert r.status_code == 201, r.text
    reader = log_in(http, r.json()["key"])
    r = http.post("/console/logout", data={"csrf": csrf(http, reader)}, headers=reader)
    assert r.status_code == 303
    assert http.get("/console/keys", headers=reader).status_code == 303


def test_unknown_console_paths_and_methods_are_pages_not_500s(http: httpx.Client) -> None:
    cookie = log_in(http, ADMIN_KEY)
    r = http.get("/console/nope", headers=cookie)
    assert r.status_code == 404 and "No console page" in r.text
    assert http.delete("/console/keys", headers=cookie).status_code == 405
    assert http.get("/console/static/vendor/missing.js").status_code == 404
