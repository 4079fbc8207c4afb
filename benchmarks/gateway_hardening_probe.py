"""Rerun the gateway hardening probes against a real gateway and the bench stub on loopback; prints JSON.

A non-streamed and a streamed request abandoned by their client after 1 s (stub: 1,200 tokens at
5 ms), requests over the context window, wrongly typed bodies, and 200 idle plus 100 header-trickling
sockets. Usage: PYTHONPATH=src python benchmarks/gateway_hardening_probe.py
"""

from __future__ import annotations

import json
import socket
import tempfile
import threading
import time
from pathlib import Path

import httpx
import orjson
import sqlalchemy as sa
import uvicorn

from tokenops.bench.stub import StubConfig, run_stub_in_thread
from tokenops.config import load_settings
from tokenops.gateway.app import create_app
from tokenops.gateway.connections import uvicorn_options
from tokenops.ops.db import engine_url

MODEL = "probe-model"
ADMIN = "probe-admin"


def start_gateway(stub_url: str, data_dir: Path):  # noqa: ANN201
    settings = load_settings(
        None,
        environ={},
        overrides={
            "port": 0,
            "data_dir": data_dir,
            "admin_key": ADMIN,
            "models": {
                MODEL: {
                    "backends": [stub_url + "/v1"],
                    "context_window": 8192,
                    "pricing": {"input": 1, "output": 2},
                }
            },
        },
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(settings),
            loop="uvloop",
            log_level="error",
            access_log=False,
            **uvicorn_options(settings.connections),
        )
    )
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    return settings, sock.getsockname()[1], server


def ledger(settings, key_id: str) -> list[dict]:  # noqa: ANN001
    engine = sa.create_engine(engine_url(settings.resolved_database_url))
    with engine.connect() as c:
        rows = c.execute(sa.text("SELECT * FROM ops_ledger WHERE key_id = :k"), {"k": key_id})
        out = [dict(r._mapping) for r in rows]
    engine.dispose()
    return out


def abandoned(port: int, key: str, key_id: str, settings, stream: bool) -> dict:  # noqa: ANN001
    body = orjson.dumps(
        {
            "model": MODEL,
            "stream": stream,
            "max_tokens": 1200,
            "messages": [{"role": "user", "content": "go"}],
        }
    )
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    time.sleep(1.0)
    s.close()
    left = time.monotonic()
    while not (rows := ledger(settings, key_id)):
        time.sleep(0.02)
    r = rows[0]
    return {
        "settled_after_client_left_s": round(time.monotonic() - left, 3),
        "status": r["status"],
        "http_status": r["http_status"],
        "output_tokens": r["output_tokens"],
        "uncached_input_tokens": r["uncached_input_tokens"],
    }


def main() -> None:
    stub_url, stop_stub = run_stub_in_thread(StubConfig(models=[MODEL], itl_s=0.005))
    settings, port, server = start_gateway(stub_url, Path(tempfile.mkdtemp()))
    base = f"http://127.0.0.1:{port}"
    admin = httpx.Client(base_url=base, headers={"authorization": f"Bearer {ADMIN}"})
    admin.post("/admin/tenants", json={"parent": None, "name": "probe"})

    def new_key(name: str) -> tuple[str, str]:
        r = admin.post("/admin/keys", json={"node": "probe", "name": name}).json()
        return r["key"], r["info"]["id"]

    out: dict = {"disconnect": {}}
    for stream in (False, True):
        key, key_id = new_key(f"gone-{stream}")
        out["disconnect"]["streamed" if stream else "non_streamed"] = abandoned(
            port, key, key_id, settings, stream
        )

    key, _ = new_key("plain")
    auth = {"authorization": f"Bearer {key}"}
    msg = [{"role": "user", "content": "hi"}]
    cases = {
        "max_tokens_100000": {"messages": msg, "max_tokens": 100_000},
        "max_tokens_1e9": {"messages": msg, "max_tokens": 1e9},
        "prompt_20000_tokens": {
            "messages": [{"role": "user", "content": "word " * 20_000}],
            "max_tokens": 10,
        },
        "max_tokens_true": {"messages": msg, "max_tokens": True},
        "stream_yes": {"messages": msg, "stream": "yes"},
        "logit_bias_abc_x": {"messages": msg, "logit_bias": {"abc": "x"}},
        "bad_content_parts": {"messages": [{"role": "user", "content": [{"type": "image_url"}, {"foo": 1}]}]},
    }
    out["refused"] = {}
    for name, body in cases.items():
        r = httpx.post(base + "/v1/chat/completions", json={"model": MODEL, **body}, headers=auth, timeout=60)
        err = r.json().get("error") or {}
        out["refused"][name] = {"status": r.status_code, "code": err.get("code"), "param": err.get("param")}

    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(200)]
    trickle = [socket.create_connection(("127.0.0.1", port)) for _ in range(100)]
    for s in trickle:
        s.sendall(b"GET /health HTTP/1.1\r\n")
    started = time.monotonic()
    while time.monotonic() - started < settings.connections.header_timeout_s + 2:
        time.sleep(5)
        for i, s in enumerate(trickle):
            try:
                s.sendall(f"x-slow-{i}: 1\r\n".encode())
            except OSError:
                pass

    def closed(s: socket.socket) -> bool:
        s.setblocking(False)
        try:
            data = s.recv(65536)
            return data.startswith(b"HTTP/1.1 408") or data == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    out["idle_connections"] = {
        "header_timeout_s": settings.connections.header_timeout_s,
        "idle_closed": sum(closed(s) for s in idle),
        "idle_opened": len(idle),
        "trickle_closed": sum(closed(s) for s in trickle),
        "trickle_opened": len(trickle),
        "observed_after_s": round(time.monotonic() - started, 1),
        "health_after": httpx.get(base + "/health").status_code,
    }
    for s in idle + trickle:
        s.close()

    # bodies trickled a byte every 5 s after complete headers: cut by the body deadline
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: probe\r\ncontent-type: application/json\r\n"
        f"authorization: Bearer {key}\r\ncontent-length: 1000\r\n\r\n"
    ).encode()
    bodies = [socket.create_connection(("127.0.0.1", port)) for _ in range(50)]
    for s in bodies:
        s.sendall(head)
    started = time.monotonic()
    while time.monotonic() - started < settings.connections.body_timeout_s + 2:
        time.sleep(5)
        for s in bodies:
            try:
                s.sendall(b" ")
            except OSError:
                pass
    out["slow_bodies"] = {
        "body_timeout_s": settings.connections.body_timeout_s,
        "closed": sum(closed(s) for s in bodies),
        "opened": len(bodies),
        "observed_after_s": round(time.monotonic() - started, 1),
        "health_after": httpx.get(base + "/health").status_code,
    }
    for s in bodies:
        s.close()
    print(json.dumps(out, indent=2))
    server.should_exit = True
    stop_stub()


if __name__ == "__main__":
    main()
