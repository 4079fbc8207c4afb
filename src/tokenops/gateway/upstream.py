"""The backend client: one pooled, keep-alive aiohttp session per gateway process for every
OpenAI-compatible backend (our engine, vLLM, SGLang, a remote provider).

This module owns connections, timeouts and the translation of transport failures into OpenAI errors
(502 when a backend cannot be reached, 504 when it does not answer in time). It does not rewrite
bodies (request.py), relay streams (sse.py) or choose a backend (queue.py).
"""

from __future__ import annotations

import aiohttp

from tokenops.gateway.queue import Backend
from tokenops.protocol import APIError


def upstream_unreachable(backend: Backend, exc: BaseException) -> APIError:
    return APIError(
        502,
        f"The backend for model '{backend.served_name}' could not be reached ({type(exc).__name__}). "
        "Retry shortly; if it persists, the operator should check the backend.",
        type="api_error",
        code="upstream_error",
    )


def upstream_timeout(backend: Backend) -> APIError:
    return APIError(
        504,
        f"The backend for model '{backend.served_name}' did not answer in time. Retry, or lower max_tokens.",
        type="api_error",
        code="upstream_timeout",
    )


class Upstream:
    """Pooled HTTP client for backends; create inside a running event loop, close on shutdown."""

    def __init__(self, *, connect_timeout_s: float = 5.0, read_timeout_s: float = 600.0) -> None:
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s)
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            # no total connection cap: the admission queue caps in-flight requests per backend
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60, ttl_dns_cache=300)
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=self._timeout,
                auto_decompress=False,
                skip_auto_headers=("User-Agent",),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def post(
        self, backend: Backend, path: str, body: bytes, request_id: str, priority: int = 0
    ) -> aiohttp.ClientResponse:
        """POST `body` to `backend.url + path`; the caller reads and releases the response.

        `x-priority` carries the key's priority class to engines that schedule by it (ours, vLLM)."""
        headers = {"content-type": "application/json", "x-request-id": request_id, "x-priority": str(priority)}
        if backend.api_key:
            headers["authorization"] = f"Bearer {backend.api_key}"
        try:
            return await self.session.post(backend.url + path, data=body, headers=headers)
        except TimeoutError:
            raise upstream_timeout(backend) from None
        except aiohttp.ClientError as exc:
            raise upstream_unreachable(backend, exc) from None
        except OSError as exc:
            raise upstream_unreachable(backend, exc) from None

    async def get_ok(self, url: str, timeout_s: float = 2.0) -> bool:
        """True when GET url answers 200 (health checks)."""
        try:
            async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False
