"""The console in a real headless browser (Debian's chromium driven by Playwright): log in, read the
numbers the pages show and check them against the ledger, create and revoke a key through the UI
(the revoked key is then refused by the API), and a read-only admin session without the forms.
Screenshots of each page go to test-artifacts/console/ (or $TOKENOPS_ARTIFACTS)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from gateway_harness import ADMIN_KEY, MODEL, RunningGateway, gateway_settings, start_gateway
from reporting_replica import reporting_replica

from tokenops.token_types import TOKEN_TYPES

pytestmark = pytest.mark.browser

CHROMIUM = os.environ.get("TOKENOPS_CHROMIUM", "/usr/bin/chromium")
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ARTIFACTS = (
    Path(os.environ.get("TOKENOPS_ARTIFACTS", Path(__file__).parents[2] / "test-artifacts")) / "console"
)

if not Path(CHROMIUM).exists() and shutil.which(CHROMIUM) is None:
    pytest.skip(
        f"no chromium at {CHROMIUM}: `apt-get install -y chromium` (or set TOKENOPS_CHROMIUM)",
        allow_module_level=True,
    )
sync_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed (pip install playwright)"
)

PROMPT = [{"role": "user", "content": "tell me about the weather in a few words"}]
TRAFFIC = 10  # ledger rows the fixture's requests write


@pytest.fixture(scope="module")
def gw(stub: tuple[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    engine_url, stop_engine = reporting_replica()
    model = {"template_overhead_tokens": 16, "pricing": {"input": 1.0, "output": 2.0}}
    gateway = start_gateway(
        gateway_settings(
            stub[0],
            tmp_path_factory.mktemp("console"),
            models={
                name: {**model, "backends": [(engine_url if name == "engine" else stub[0]) + "/v1"]}
                for name in (MODEL, "cheap", "strong", "engine")
            },
            routes={"auto": {"cheap": "cheap", "strong": "strong", "strategy": "route", "router": "rules"}},
            cache={"enabled": True, "semantic": False},
            cluster={
                "load_poll_interval_s": 0.1,
                "models": {"engine": {"kinds": {engine_url + "/v1": "tokenops"}}},
            },
        )
    )
    # traffic on three keys in two tenants; acme/shop/web has a budget whose alert fires, acme/jobs/batch
    # asks one question three times (two cache hits), globex/main/app uses a route and the engine
    keys = {
        "web": gateway.new_key("web", {"budget_micros": 2_000, "alert_threshold": 0.01}, "acme", "shop"),
        "batch": gateway.new_key("batch", {}, "acme", "jobs"),
        "app": gateway.new_key("app", {}, "globex", "main"),
    }
    web = gateway.client(keys["web"])
    for _ in range(4):
        web.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=16)
    for _ in range(3):
        gateway.client(keys["batch"]).chat.completions.create(model=MODEL, messages=PROMPT, temperature=0)
    app = gateway.client(keys["app"])
    app.chat.completions.create(model="auto", messages=PROMPT)
    app.chat.completions.create(model="auto", messages=PROMPT, extra_headers={"x-tokenops-task": "math"})
    app.chat.completions.create(model="engine", messages=PROMPT)
    gateway.wait_ledger(TRAFFIC)
    yield gateway
    gateway.stop()
    stop_engine()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        yield b
        b.close()


def login(browser: Any, gw: RunningGateway, key: str) -> Any:
    page = browser.new_page(viewport={"width": 1360, "height": 900})
    page.goto(gw.url + "/console/usage")
    assert "/console/login" in page.url  # a page without a session asks for a login first
    page.fill("input[name=key]", key)
    page.click("button[type=submit]")
    page.wait_for_url("**/console/usage")
    return page


def shot(page: Any, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def cells(page: Any, row_selector: str) -> dict[str, str]:
    row = page.locator(row_selector)
    return {
        td.get_attribute("data-field"): td.inner_text().strip() for td in row.locator("td[data-field]").all()
    }


def as_int(text: str) -> int:
    return int(text.replace(",", ""))


def as_micros(text: str) -> int:
    return round(float(text.replace(",", "")) * 1_000_000)


def ledger_sums(rows: list[dict[str, Any]]) -> dict[str, int]:
    out = {"requests": len(rows), "cost": sum(r["cost_micros"] for r in rows)}
    for t in TOKEN_TYPES:
        out[t.name] = sum(r[t.column] for r in rows)
    return out


def shown(values: dict[str, str]) -> dict[str, int]:
    out = {k: as_int(values[k]) for k in ("requests", *(t.name for t in TOKEN_TYPES))}
    out["cost"] = as_micros(values["cost"])
    return out


def test_usage_numbers_match_the_ledger_down_the_key_tree(browser: Any, gw: RunningGateway) -> None:
    page = login(browser, gw, ADMIN_KEY)
    assert page.inner_text("[data-testid=role]") == "admin"
    ledger = gw.ledger()
    assert len(ledger) == TRAFFIC
    page.wait_for_selector("#tokens-chart canvas")  # uPlot drew the chart from the vendored script
    shot(page, "usage")
    assert shown(cells(page, "[data-testid=totals] tr:nth-child(2)")) == ledger_sums(ledger)
    for tenant in ("acme", "globex"):
        rows = [r for r in ledger if r["tenant"] == tenant]
        assert shown(cells(page, f"[data-testid=breakdown] tr[data-node='{tenant}']")) == ledger_sums(rows)

    page.click("[data-testid=breakdown] tr[data-node='acme'] a")  # drill down: acme -> its projects
    page.wait_for_url("**node=acme**")
    for project in ("acme/shop", "acme/jobs"):
        rows = [r for r in ledger if r["node_path"].startswith(project + "/")]
        assert shown(cells(page, f"[data-testid=breakdown] tr[data-node='{project}']")) == ledger_sums(rows)
    page.click("[data-testid=breakdown] tr[data-node='acme/shop'] a")
    page.click("[data-testid=breakdown] tr[data-node='acme/shop/web'] a")  # down to the key
    page.wait_for_url("**node=acme/shop/web*")
    rows = [r for r in ledger if r["node_path"] == "acme/shop/web"]
    assert shown(cells(page, "[data-testid=totals] tr:nth-child(2)")) == ledger_sums(rows)
    assert shown(cells(page, f"[data-testid=models] tr[data-model='{MODEL}']")) == ledger_sums(rows)
    shot(page, "usage-key")
    page.close()


def test_budgets_show_spent_reserved_and_the_alert(browser: Any, gw: RunningGateway) -> None:
    page = login(browser, gw, ADMIN_KEY)
    page.click("nav a[href='/console/budgets']")
    spent = sum(r["cost_micros"] for r in gw.ledger(node_path="acme/shop/web"))
    row = cells(page, "[data-testid=budgets] tr[data-node='acme/shop/web']")
    assert as_micros(row["spent"]) == spent > 0
    assert as_micros(row["limit"]) == 2_000
    assert as_micros(row["reserved"]) == 0 and row["reservations"] == "0"  # nothing in flight
    assert page.locator("[data-testid=alerts] tr[data-node='acme/shop/web']").count() == 1
    shot(page, "budgets")
    page.click("nav a[href='/console/fleet']")
    engine = page.locator("tr[data-replica='engine#0']")
    for _ in range(50):  # the poller reads the replica's own report every 0.1 s
        if engine.locator("[data-field=kv_usage]").inner_text() != "-":
            break
        page.wait_for_timeout(100)
        page.reload()
    assert engine.locator("[data-field=kv_usage]").inner_text() == "25.0%"
    assert engine.locator("[data-field=prefix_hit_rate]").inner_text() == "75.0%"
    assert "closed" in engine.locator("[data-field=breaker]").inner_text().lower()
    assert page.inner_text("[data-testid=cache] [data-field=hits-exact]") == "2"
    route = page.locator("[data-testid=route][data-route='auto']")
    assert route.locator("tr[data-model='strong'] [data-field=share]").inner_text() == "50.0%"
    shot(page, "fleet")
    page.close()


def test_create_and_revoke_a_key_through_the_ui(browser: Any, gw: RunningGateway) -> None:
    page = login(browser, gw, ADMIN_KEY)
    page.click("nav a[href='/console/keys']")
    form = page.locator("[data-testid=create-key]")
    form.locator("select[name=node]").select_option("globex/main")
    form.locator("input[name=name]").fill("from-ui")
    form.locator("input[name=rpm]").fill("100")
    form.locator("button[type=submit]").click()
    page.wait_for_selector("[data-testid=new-key]")
    shot(page, "key-created")
    key = page.inner_text("[data-testid=new-key]").strip()
    key_id = page.inner_text("[data-testid=key-id]").strip()
    assert key.startswith("tok-")
    reply = gw.client(key).chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=4)
    assert reply.choices[0].message.content

    page.click("nav a[href='/console/keys']")
    assert page.inner_text(f"[data-testid=keys] tr[data-key='{key_id}'] [data-field=state]") == "active"
    assert key not in page.content()  # the key is shown once, never in the list
    page.click(f"[data-testid=keys] tr[data-key='{key_id}'] [data-testid=revoke] button")
    page.wait_for_url("**/console/keys")
    assert page.inner_text(f"[data-testid=keys] tr[data-key='{key_id}'] [data-field=state]") == "revoked"
    shot(page, "keys")
    with pytest.raises(openai.AuthenticationError):
        gw.client(key).chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=4)
    page.close()


def test_a_read_only_admin_sees_the_console_without_its_forms(browser: Any, gw: RunningGateway) -> None:
    r = gw.admin("POST", "/admin/keys", json={"node": "acme", "name": "auditor", "scopes": ["admin:read"]})
    assert r.status_code == 201, r.text
    page = login(browser, gw, r.json()["key"])
    assert page.inner_text("[data-testid=role]") == "read-only admin"
    page.click("nav a[href='/console/keys']")
    assert page.locator("[data-testid=keys] tr[data-key]").count() >= 4
    assert page.locator("[data-testid=create-key]").count() == 0
    assert page.locator("[data-testid=revoke]").count() == 0
    page.close()


def test_a_wrong_key_does_not_log_in(browser: Any, gw: RunningGateway) -> None:
    page = browser.new_page()
    page.goto(gw.url + "/console/login")
    page.fill("input[name=key]", "tok-not-a-key")
    page.click("button[type=submit]")
    assert "not an admin key" in page.inner_text("[data-testid=error]")
    page.goto(gw.url + "/console/keys")
    assert "/console/login" in page.url
    page.close()
