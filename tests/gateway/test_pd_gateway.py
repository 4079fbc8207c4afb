"""PD through the real gateway: a model configured with a prefill pool and a decode pool, served by
real engine servers on loopback (the tiny random Llama), asked with the official openai SDK. Its
answers, streamed or not, are a colocated engine's greedy tokens; each request leaves one ledger row
with the decode leg's usage and, as its incremental prefill, the prompt tokens the engines computed
(read back from the engines' own counters); a prefill worker that is gone still gets the request
answered and billed once."""

from __future__ import annotations

import copy
import time

import httpx
import openai
import pytest
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families

from tiny_server import ByteTokenizer, start_server
from tokenops.config import load_settings
from tokenops.engine.server import serve_in_thread
from tokenops.gateway.app import create_app

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny-pd"
SOLO = "tiny-solo"
ADMIN = "pd-admin-key"
USAGE = {"include_usage": True}
PROMPT = "the agent called a tool and read forty lines of its output before it answered. "


def _engine(tiny_llama, role: str):
    _, app, ctx = start_server(copy.deepcopy(tiny_llama.model), ByteTokenizer(), MODEL)
    app.state.server.config.role = role
    return ctx


def _computed(url: str) -> int:
    """Prompt tokens this engine computed so far: its prompt tokens less those its caches held."""
    totals = {"tokenops_engine_prompt_tokens": 0.0, "tokenops_engine_cached_prompt_tokens": 0.0}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        if fam.name in totals:
            totals[fam.name] += sum(s.value for s in fam.samples if s.name.endswith("_total"))
    return int(totals["tokenops_engine_prompt_tokens"] - totals["tokenops_engine_cached_prompt_tokens"])


def _ledger(db_url: str, n: int, model: str = MODEL) -> list[dict]:
    engine = sa.create_engine(db_url)
    try:
        deadline = time.monotonic() + 10
        while True:
            with engine.connect() as conn:
                rows = [
                    dict(r._mapping)
                    for r in conn.execute(
                        sa.text("SELECT * FROM ops_ledger WHERE model_requested = :m ORDER BY id"),
                        {"m": model},
                    )
                ]
            if len(rows) >= n or time.monotonic() > deadline:
                return rows
            time.sleep(0.05)
    finally:
        engine.dispose()


def _key(gw_url: str, name: str) -> str:
    with httpx.Client(base_url=gw_url, headers={"authorization": f"Bearer {ADMIN}"}, timeout=30) as admin:
        admin.post("/admin/tenants", json={"parent": None, "name": "org"})
        admin.post("/admin/tenants", json={"parent": "org", "name": "proj"})
        r = admin.post("/admin/keys", json={"node": "org/proj", "name": name, "limits": {}})
        assert r.status_code == 201, r.text
        return r.json()["key"]


def _client(gw_url: str, key_name: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw_url + "/v1", api_key=_key(gw_url, key_name), max_retries=0, timeout=60)


def test_pd_model_through_the_gateway(tiny_llama, tmp_path):
    p_ctx, d_ctx, solo_ctx = (_engine(tiny_llama, r) for r in ("prefill", "decode", "both"))
    with d_ctx as d_url, solo_ctx as solo_url, p_ctx as p_url:
        settings = load_settings(
            None,
            environ={},
            overrides={
                "host": "127.0.0.1",
                "port": 0,
                "data_dir": tmp_path,
                "admin_key": ADMIN,
                "models": {
                    MODEL: {
                        "pd": {"policy": "static", "prefill": [p_url + "/v1"], "decode": [d_url + "/v1"]},
                        "context_window": 256,
                        "template_overhead_tokens": 0,
                        "pricing": {"input": 1.0, "output": 2.0},
                    },
                    SOLO: {
                        "backends": [solo_url + "/v1"],
                        "served_name": MODEL,
                        "context_window": 256,
                        "template_overhead_tokens": 0,
                    },
                },
            },
        )
        with serve_in_thread(create_app(settings)) as gw_url:
            client = _client(gw_url, "first")
            ask = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}
            oracle = client.completions.create(model=SOLO, **ask).choices[0].text

            # streamed: the decode leg relayed chunk by chunk, the colocated engine's greedy tokens
            before = _computed(p_url) + _computed(d_url)
            stream = client.completions.create(
                model=MODEL, stream=True, stream_options=USAGE, extra_headers={"x-session-id": "s1"}, **ask
            )
            chunks = list(stream)
            assert "".join(c.choices[0].text for c in chunks if c.choices) == oracle
            usage = chunks[-1].usage
            streamed_computed = _computed(p_url) + _computed(d_url) - before
            sources = usage.model_extra["prompt_token_sources"]
            assert sources["transferred"] > 0  # the decode engine pulled the prompt's KV, it did not prefill

            # not streamed, the session's next round: the same tokens as colocated
            follow = PROMPT + oracle + " then it called another tool. "
            solo_next = client.completions.create(model=SOLO, **{**ask, "prompt": follow}).choices[0].text
            before = _computed(p_url) + _computed(d_url)
            answer = client.completions.create(
                model=MODEL, extra_headers={"x-session-id": "s1"}, **{**ask, "prompt": follow}
            )
            assert answer.choices[0].text == solo_next
            next_computed = _computed(p_url) + _computed(d_url) - before

            rows = _ledger(settings.resolved_database_url, 2)
            assert len(rows) == 2 and all(r["status"] == "ok" for r in rows)
            for row, (u, computed) in zip(
                rows, [(usage, streamed_computed), (answer.usage, next_computed)], strict=True
            ):
                # the decode leg's usage is the billed one; the prefill leg's first token is not billed
                assert row["uncached_input_tokens"] + row["cached_input_tokens"] == u.prompt_tokens
                assert row["output_tokens"] == u.completion_tokens == 12
                assert row["incremental_prefill_tokens"] == min(computed, u.prompt_tokens)
            # the second round's history was in the engines' caches: far less than its prompt computed
            assert rows[1]["incremental_prefill_tokens"] < answer.usage.prompt_tokens // 2
            # a colocated tokenops engine reports its sources too: its second prompt (no session) is
            # metered as what its prefix cache lacked, not as the whole prompt
            solo = _ledger(settings.resolved_database_url, 2, SOLO)
            assert solo[1]["cached_input_tokens"] > 0
            assert solo[1]["incremental_prefill_tokens"] == solo[1]["uncached_input_tokens"]

        # the prefill worker is gone: the decode worker prefills itself, answered once, billed once
        with serve_in_thread(create_app(settings)) as gw_url:
            client = _client(gw_url, "second")
            p_ctx.__exit__(None, None, None)
            other = "a different prompt the decode engine has never seen, about a build that failed. "
            oracle = client.completions.create(model=SOLO, **{**ask, "prompt": other}).choices[0].text
            before = _computed(d_url)
            stream = client.completions.create(
                model=MODEL, stream=True, stream_options=USAGE, **{**ask, "prompt": other}
            )
            chunks = list(stream)
            assert "".join(c.choices[0].text for c in chunks if c.choices) == oracle
            assert chunks[-1].usage.model_extra["prompt_token_sources"]["transferred"] == 0
            rows = _ledger(settings.resolved_database_url, 3)
            assert len(rows) == 3 and rows[2]["status"] == "ok"
            assert rows[2]["output_tokens"] == 12
            computed = _computed(d_url) - before
            assert rows[2]["incremental_prefill_tokens"] == computed == chunks[-1].usage.prompt_tokens
