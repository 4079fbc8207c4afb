"""A tiny OpenAI-compatible replica for cluster tests, with a failure knob.

Serves `/v1/chat/completions` (JSON or SSE; every answer names the replica), `/health`, `/v1/load`
(our engine's JSON shape) and `/metrics` (vLLM's Prometheus names). `POST /admin/fail` with
`{"mode": ..., "count": n}` makes the next n chat requests fail: `500`/`400` answer that status, `drop`
closes the connection before the first byte, `midstream` breaks the stream after the first chunk, `slow`
waits `delay` seconds before the first byte. The same endpoint sets `events`, served by `/v1/kv_events`.
Run: `python tests/cluster/replica_app.py --port P --name N`.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route


def build_app(name: str) -> Starlette:
    state = {
        "mode": "none",
        "count": 0,
        "delay": 0.0,
        "running": 0,
        "served": 0,
        "healthy": True,
        "events": [],
    }

    def take_failure() -> str:
        if state["count"] > 0:
            state["count"] -= 1
            return str(state["mode"])
        return "none"

    async def chat(request: Request) -> Response:
        body = await request.json()
        mode = take_failure()
        if mode in ("500", "400"):
            return JSONResponse({"error": {"message": "injected", "type": "injected"}}, status_code=int(mode))
        if mode == "slow":
            await asyncio.sleep(float(state["delay"]))
        n_chunks = int(body.get("max_tokens") or 3)
        delay = float(body.get("chunk_delay", 0.0))
        state["served"] += 1

        async def stream():  # noqa: ANN202
            state["running"] += 1
            try:
                if mode == "drop":
                    raise RuntimeError("injected drop before the first byte")
                for i in range(n_chunks):
                    chunk = {
                        "id": "c",
                        "object": "chat.completion.chunk",
                        "model": body["model"],
                        "replica": name,
                    }
                    chunk["choices"] = [{"index": 0, "delta": {"content": f"t{i} "}}]
                    yield f"data: {json.dumps(chunk)}\n\n".encode()
                    if mode == "midstream":
                        raise RuntimeError("injected break mid-stream")
                    if delay:
                        await asyncio.sleep(delay)
                yield b"data: [DONE]\n\n"
            finally:
                state["running"] -= 1

        if body.get("stream"):
            return StreamingResponse(stream(), media_type="text/event-stream")
        if mode in ("drop", "midstream"):
            return StreamingResponse(stream(), media_type="application/json")
        return JSONResponse({"object": "chat.completion", "model": body["model"], "replica": name})

    async def fail(request: Request) -> Response:
        state.update(await request.json())
        return JSONResponse({"ok": True})

    async def health(request: Request) -> Response:
        return JSONResponse({"ok": True}) if state["healthy"] else JSONResponse({}, status_code=503)

    async def load(request: Request) -> Response:
        return JSONResponse(
            {"running": state["running"], "waiting": 0, "kv_usage": 0.25, "served": state["served"]}
        )

    async def kv_events(request: Request) -> Response:
        since = int(request.query_params.get("since", "0"))
        events = [e for e in state["events"] if e["seq_no"] >= since][:2]  # small pages: the poller loops
        return JSONResponse(
            {"events": events, "next": events[-1]["seq_no"] + 1 if events else since, "missed": False}
        )

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(
            '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="m"} '
            f"{state['running']}\n"
            '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name="m"} 2\n'
            '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name="m"} 0.5\n'
        )

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/admin/fail", fail, methods=["POST"]),
            Route("/health", health),
            Route("/v1/load", load),
            Route("/metrics", metrics),
            Route("/v1/kv_events", kv_events),
        ]
    )


if __name__ == "__main__":
    import uvicorn

    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--name", default="replica")
    a = ap.parse_args()
    uvicorn.run(build_app(a.name), host="127.0.0.1", port=a.port, log_level="critical", lifespan="off")
