"""A replica for the console's fleet tests: answers chats and reports its load in our engine's
`/v1/load` shape (running, waiting, KV usage, prefix-cache lookups and hits), served on loopback."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

LOAD = {"running": 3, "waiting": 2, "kv_usage": 0.25, "prefix_cache_queries": 40, "prefix_cache_hits": 30}


def reporting_replica() -> tuple[str, Callable[[], None]]:
    """A replica that answers chats and reports its load in our engine's `/v1/load` shape."""
    import uvicorn

    async def chat(request: Request) -> JSONResponse:
        return JSONResponse(
            {
                "id": "c",
                "object": "chat.completion",
                "created": 0,
                "model": "engine",
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
                ],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
            }
        )

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/load", lambda r: JSONResponse(LOAD)),
            Route("/health", lambda r: JSONResponse({"ok": True})),
        ]
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=5)

    return f"http://127.0.0.1:{sock.getsockname()[1]}", stop
