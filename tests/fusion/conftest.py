"""Fixtures for the fusion tests: a real OpenAI-compatible server on loopback whose models answer
from scripts (a function of the prompt, temperature and seed), standing for cheap and strong models,
and a toy embedder for tests that need no MiniLM."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tokenops.fusion.suites import TaskItem, reference_output

# (prompt, temperature, seed) -> (text, token log-probs)
Script = Callable[[str, float, int | None], tuple[str, list[float]]]


def scripted_app(models: dict[str, Script], calls: list[dict[str, Any]]) -> Starlette:
    async def chat(request: Request) -> JSONResponse:
        return await answer(request, chat=True)

    async def completions(request: Request) -> JSONResponse:
        return await answer(request, chat=False)

    async def answer(request: Request, *, chat: bool) -> JSONResponse:
        body = await request.json()
        name = body.get("model")
        if name not in models:
            return JSONResponse(
                {
                    "error": {
                        "message": f"no model {name}",
                        "type": "invalid_request_error",
                        "param": "model",
                        "code": "model_not_found",
                    }
                },
                status_code=404,
            )
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        temperature = float(body.get("temperature") or 0.0)
        n = int(body.get("n") or 1)
        seed = body.get("seed")
        # n choices: choice k is the script's answer at seed + k (one prompt, n completions)
        scripted = [models[name](prompt, temperature, seed if n == 1 else (seed or 0) + k) for k in range(n)]
        calls.append({"model": name, "prompt": prompt, "temperature": temperature, "chat": chat, "n": n})
        completion = sum(max(len(lps), 1) for _, lps in scripted)
        usage = {
            "prompt_tokens": len(prompt.split()),
            "completion_tokens": completion,
            "total_tokens": len(prompt.split()) + completion,
        }
        choices = []
        for k, (text, lps) in enumerate(scripted):
            if chat:
                logprobs = (
                    {
                        "content": [
                            {"token": "t", "logprob": lp, "bytes": None, "top_logprobs": []} for lp in lps
                        ]
                    }
                    if body.get("logprobs")
                    else None
                )
                choices.append({
                    "index": k,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": logprobs,
                    "finish_reason": "stop",
                })  # fmt: skip
            else:
                logprobs = (
                    {
                        "tokens": ["t"] * len(lps),
                        "token_logprobs": lps,
                        "top_logprobs": None,
                        "text_offset": list(range(len(lps))),
                    }
                    if body.get("logprobs") is not None
                    else None
                )
                choices.append({"index": k, "text": text, "logprobs": logprobs, "finish_reason": "stop"})
        obj = "chat.completion" if chat else "text_completion"
        return JSONResponse(
            {"id": "x-1", "object": obj, "created": 1, "model": name, "choices": choices, "usage": usage}
        )

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
        ]
    )


@pytest.fixture
def scripted_server():
    """`scripted_server(models)` -> (base URL ending in /v1, list of calls received)."""
    import uvicorn

    stops: list[Callable[[], None]] = []

    def start(models: dict[str, Script]) -> tuple[str, list[dict[str, Any]]]:
        calls: list[dict[str, Any]] = []
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        server = uvicorn.Server(
            uvicorn.Config(scripted_app(models, calls), log_level="critical", lifespan="off")
        )
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "scripted server did not start"
            time.sleep(0.005)

        def stop() -> None:
            server.should_exit = True
            thread.join(timeout=5)
            sock.close()

        stops.append(stop)
        return f"http://127.0.0.1:{port}/v1", calls

    yield start
    for s in stops:
        s()


@pytest.fixture(scope="session")
def embedder():
    from tokenops.embeddings import shared_embedder

    return shared_embedder()


# Scripts for the loopback models: a "strong" model that answers every suite item right and a
# "cheap" one that answers only easy (level 1) items right.


def _suite_scripts(items: list[TaskItem], cheap_levels: tuple[int, ...] = (1,)):
    by_prompt: dict[str, tuple[TaskItem, str]] = {}
    for item in items:
        by_prompt[item.instruction] = (item, "chat")
        by_prompt[item.completion_prompt] = (item, "completion")

    def strong(prompt: str, temperature: float, seed: int | None) -> tuple[str, list[float]]:
        item, mode = by_prompt[prompt]
        return reference_output(item, mode), [-0.01, -0.02]  # type: ignore[arg-type]

    def cheap(prompt: str, temperature: float, seed: int | None) -> tuple[str, list[float]]:
        item, mode = by_prompt[prompt]
        if item.level in cheap_levels:
            return reference_output(item, mode), [-0.05, -0.1]  # type: ignore[arg-type]
        return "I am not sure", [-2.5, -3.0]

    return {"cheap": cheap, "strong": strong}


@pytest.fixture
def suite_scripts():
    return _suite_scripts
