"""The cached share of each round of a long agent session, gateway-held memory against client-held.

One real engine (SmolLM2-135M-Instruct, the bundled model, prefix cache on) behind one gateway. Two
sessions of the same rounds, interleaved round by round so the machine's load falls on both alike:

- `responses`: the client sends only the round's new input with `previous_response_id`; the gateway
  rebuilds the history, resends it, and compacts it when it outgrows its budget;
- `chat`: the client keeps the history itself and resends it whole on `/v1/chat/completions` (what
  an agent framework does without a Responses API); it is never compacted, so it stops once the
  history no longer fits the window. Its system prompt starts with other words, so the two sessions
  share nothing in the engine's prefix cache.

Each round's new input is a tool result of about `--input-tokens` tokens. Per round it prints the
prompt tokens, the cached tokens the engine reported and their share, and whether the gateway
compacted the session before that round (a ledger row with operation=compaction). JSON on stdout.
The figures are token counts, not timings: they do not depend on the machine's load.

Run:  .venv/bin/python benchmarks/responses_session_cache.py [--rounds 24] [--window 2048]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import sqlalchemy as sa

from tokenops.config import load_settings
from tokenops.engine.config import EngineConfig
from tokenops.engine.llm_engine import LLMEngine
from tokenops.engine.loader import load_model
from tokenops.engine.server import ServerConfig, build_app, serve_in_thread
from tokenops.gateway.app import create_app
from tokenops.ops.db import engine_url

MODEL = "smollm2-135m-instruct"
ADMIN = "bench-admin"
INSTRUCTIONS = (
    "You are an operations agent. Each turn you receive the output of a tool. Read it, say in one "
    "short sentence what it shows, and name the next check to run."
)
WORDS = "disk latency queue replica shard cache warm cold retry timeout healthy degraded node pool".split()


def tool_output(k: int, tokens: int, rng: random.Random) -> str:
    rows = [
        f"check {k}.{i}: {rng.choice(WORDS)} {rng.choice(WORDS)} = {rng.randint(0, 999)}"
        for i in range(tokens // 10)
    ]
    return f"Tool result of round {k}:\n" + "\n".join(rows)


def start_gateway(settings: Any) -> tuple[str, Any]:
    import uvicorn

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(settings), log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=10)

    return f"http://127.0.0.1:{sock.getsockname()[1]}", stop


def compactions(settings: Any) -> int:
    engine = sa.create_engine(engine_url(settings.resolved_database_url))
    with engine.connect() as conn:
        n = conn.execute(sa.text("SELECT count(*) FROM ops_ledger WHERE operation = 'compaction'")).scalar()
    engine.dispose()
    return int(n or 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=24)
    ap.add_argument("--window", type=int, default=2048, help="context window of engine and gateway")
    ap.add_argument(
        "--input-tokens", type=int, default=100, help="about this many tokens of tool output a round"
    )
    ap.add_argument("--output-tokens", type=int, default=24)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    started = time.time()
    load_at_start = os.getloadavg()[0]

    loaded = load_model(MODEL)
    engine = LLMEngine.from_loaded(loaded, EngineConfig(max_model_len=args.window))
    config = ServerConfig(served_model_names=[MODEL], max_model_len=args.window)
    rows: list[dict[str, Any]] = []
    with (
        serve_in_thread(build_app(engine, loaded.tokenizer, config)) as engine_base,
        tempfile.TemporaryDirectory() as tmp,
    ):
        # one request straight to the engine first: its first forward passes are the slow ones
        httpx.post(
            engine_base + "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            timeout=900,
        )
        settings = load_settings(
            None,
            environ={},
            overrides={
                "port": 0,
                "data_dir": tmp,
                "admin_key": ADMIN,
                "cache": {"enabled": False},
                # a cold engine on a loaded machine answers its first requests late
                "cluster": {"retry": {"attempts": 1, "first_byte_timeout_s": 900}},
                "models": {MODEL: {"backends": [engine_base + "/v1"], "context_window": args.window}},
            },
        )
        url, stop = start_gateway(settings)
        try:
            admin = httpx.Client(base_url=url, headers={"authorization": f"Bearer {ADMIN}"}, timeout=30)
            admin.post("/admin/tenants", json={"parent": None, "name": "bench"})
            key = admin.post("/admin/keys", json={"node": "bench", "name": "agent"}).json()["key"]
            client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=600)
            rng = random.Random(7)
            previous = None
            # its own first words: the two sessions share no prefix in the engine's cache
            history: list[dict[str, Any]] = [
                {"role": "system", "content": "Client-held session. " + INSTRUCTIONS}
            ]
            chat_alive = True
            for k in range(args.rounds):
                text = tool_output(k, args.input_tokens, rng)
                before = compactions(settings)
                r = client.responses.create(
                    model=MODEL,
                    instructions=INSTRUCTIONS,
                    input=text,
                    previous_response_id=previous,
                    max_output_tokens=args.output_tokens,
                    temperature=0,
                )
                row: dict[str, Any] = {
                    "round": k,
                    "responses": {
                        "prompt_tokens": r.usage.input_tokens,
                        "cached_tokens": r.usage.input_tokens_details.cached_tokens,
                        "cached_share": round(
                            r.usage.input_tokens_details.cached_tokens / r.usage.input_tokens, 3
                        ),
                        "compacted_before": compactions(settings) > before,
                    },
                }
                previous = r.id
                history.append({"role": "user", "content": text})
                if chat_alive:
                    try:
                        c = client.chat.completions.create(
                            model=MODEL, messages=history, max_tokens=args.output_tokens, temperature=0
                        )
                    except openai.BadRequestError:
                        chat_alive = False  # the client-held history no longer fits the window
                        row["chat"] = "context_length_exceeded"
                    else:
                        cached = c.usage.prompt_tokens_details.cached_tokens
                        row["chat"] = {
                            "prompt_tokens": c.usage.prompt_tokens,
                            "cached_tokens": cached,
                            "cached_share": round(cached / c.usage.prompt_tokens, 3),
                        }
                        history.append({"role": "assistant", "content": c.choices[0].message.content})
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            stop()

    def median_share(side: str, rounds: list[dict[str, Any]]) -> float | None:
        xs = [r[side]["cached_share"] for r in rounds if isinstance(r.get(side), dict)]
        return round(statistics.median(xs), 3) if xs else None

    later = rows[1:]
    appended = [r for r in later if not r["responses"]["compacted_before"]]
    summary = {
        "benchmark": "responses_session_cache",
        "machine": platform.processor() or platform.machine(),
        "date_utc": dt.datetime.fromtimestamp(started, dt.UTC).strftime("%Y-%m-%d %H:%M"),
        "load_average": [round(load_at_start, 1), round(os.getloadavg()[0], 1)],
        "args": vars(args) | {"json": str(args.json) if args.json else None},
        "responses_rounds": len(rows),
        "chat_rounds": sum(isinstance(r.get("chat"), dict) for r in rows),
        "compactions": sum(r["responses"]["compacted_before"] for r in rows),
        "median_cached_share": {
            "responses_after_round_0": median_share("responses", later),
            "responses_appending_rounds": median_share("responses", appended),
            "chat_after_round_0": median_share("chat", later),
        },
        "rounds": rows,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "rounds"}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
