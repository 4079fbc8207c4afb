"""`/v1/embeddings`: the bundled sentence embedder served in the gateway, or a configured model's
backends passed through the cluster; either way admitted and metered as input tokens.

The bundled embedder (tokenops.embeddings, all-MiniLM-L6-v2) answers under `embeddings.model`; its
forward pass runs in a worker thread. Any other name must be a configured model, whose replicas get
the request as the client sent it (their own `usage.prompt_tokens` is what is billed). An admitted
request settles exactly once, with `operation=embeddings` on its ledger row.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from typing import TYPE_CHECKING, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tokenops.cluster import DispatchRequest, RequestInfo
from tokenops.gateway.http import (
    ClientGone,
    Receive,
    Scope,
    Send,
    base_headers,
    bearer_token,
    next_request_id,
    read_body,
    send_bytes,
    send_error,
)
from tokenops.gateway.upstream import UPSTREAM_FAULTS, upstream_broken, upstream_error
from tokenops.ops.domain import AdmissionRequest, Outcome, TokenUsage
from tokenops.protocol import APIError, from_validation_error, invalid_request, model_not_found

if TYPE_CHECKING:
    from tokenops.gateway.app import Gateway

log = logging.getLogger("tokenops.gateway")

# per input: the [CLS]/[SEP] pieces and a margin, on top of one token per UTF-8 byte at most
PER_INPUT_TOKENS = 4


class EmbeddingsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None

    def texts(self) -> list[str] | None:
        """The inputs as texts; None when they are token ids."""
        if isinstance(self.input, str):
            return [self.input]
        if all(isinstance(x, str) for x in self.input):
            return list(self.input)  # type: ignore[arg-type]
        return None


def _encode(vector: Any, fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.tolist()


class EmbeddingsEndpoint:
    """POST handler for /v1/embeddings."""

    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gw = self.gw
        request_id = next_request_id()
        try:
            raw = await read_body(scope, receive, gw.settings.max_body_bytes)
            req = self._parse(raw)
            principal = await gw.ops.authenticate(bearer_token(scope))
            local = gw.settings.embeddings.enabled and req.model == gw.settings.embeddings.model
            texts = req.texts()
            if local and texts is None:
                raise invalid_request(
                    f"The model '{req.model}' takes text inputs, not token ids.", param="input"
                )
            if not local and req.model not in gw.settings.models:
                names = [
                    *gw.settings.models,
                    *([gw.settings.embeddings.model] if gw.settings.embeddings.enabled else []),
                ]
                raise model_not_found(req.model, names)
            most = gw.settings.embeddings.max_inputs
            if texts is not None and len(texts) > most:
                raise invalid_request(
                    f"'input' has {len(texts)} items; at most {most} are accepted.",
                    param="input",
                )
            upper = (
                sum(len(t.encode()) + PER_INPUT_TOKENS for t in texts)
                if texts is not None
                else sum(len(x) if isinstance(x, list) else 1 for x in req.input)  # type: ignore[union-attr]
            )
            admission = await gw.ops.admit(
                principal,
                AdmissionRequest(
                    model=req.model, prompt_tokens_upper=upper, max_tokens=1, context_window=upper + 1
                ),
            )
        except ClientGone:
            return
        except APIError as err:
            gw.metrics.refused(err.code or err.type)
            await send_error(send, err, request_id)
            return
        started = time.perf_counter()
        outcome = Outcome(
            model_served=req.model,
            usage=TokenUsage(),
            status="error",
            http_status=500,
            operation="embeddings",
        )
        try:
            if local:
                assert texts is not None
                body, tokens = await asyncio.to_thread(self._embed_local, req, texts)
            else:
                body, tokens = await self._pass_through(req, raw, request_id, admission.priority)
            outcome.usage = TokenUsage(uncached_input=tokens)
            outcome.status, outcome.http_status = "ok", 200
            await send_bytes(
                send, 200, body, base_headers(request_id, [(b"x-tokenops-model", req.model.encode())])
            )
        except APIError as err:
            outcome.error_code, outcome.http_status = err.code, err.status
            await send_error(send, err, request_id)
        except Exception:
            from tokenops.gateway.routes import internal_error

            log.exception("embeddings request %s failed", request_id)
            outcome.error_code = "internal_error"
            await send_error(send, internal_error(), request_id)
        finally:
            outcome.latency_ms = (time.perf_counter() - started) * 1000
            try:
                await gw.ops.settle(admission, outcome)
            except Exception:
                log.exception("settle failed for admission %s", admission.id)

    @staticmethod
    def _parse(raw: bytes) -> EmbeddingsRequest:
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise invalid_request(
                f"The request body is not valid JSON ({exc.msg} at position {exc.pos}).", code="invalid_json"
            ) from None
        if not isinstance(body, dict):
            raise invalid_request("The request body must be a JSON object.", code="invalid_json")
        try:
            req = EmbeddingsRequest.model_validate(body)
        except ValidationError as exc:
            raise from_validation_error(exc) from None
        if isinstance(req.input, list) and not req.input:
            raise invalid_request("'input' must not be empty.", param="input")
        return req

    def _embed_local(self, req: EmbeddingsRequest, texts: list[str]) -> tuple[bytes, int]:
        from tokenops.embeddings import DIMENSIONS, shared_embedder

        if req.dimensions is not None and req.dimensions != DIMENSIONS:
            raise invalid_request(
                f"The model '{req.model}' has {DIMENSIONS} dimensions; 'dimensions' cannot change that.",
                param="dimensions",
            )
        embedder = shared_embedder()
        vectors = embedder.embed(texts)
        # what the encoder reads of each text (it truncates at its window)
        tokens = sum(len(e.ids) for e in embedder.tokenizer.encode_batch(texts))
        data = [
            {"object": "embedding", "index": i, "embedding": _encode(v, req.encoding_format)}
            for i, v in enumerate(vectors)
        ]
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return orjson.dumps({"object": "list", "data": data, "model": req.model, "usage": usage}), tokens

    async def _pass_through(
        self, req: EmbeddingsRequest, raw: bytes, request_id: str, priority: int
    ) -> tuple[bytes, int]:
        body = orjson.loads(raw)
        dispatch = DispatchRequest(
            RequestInfo(model=req.model, priority=priority),
            "/embeddings",
            body,
            {"x-request-id": request_id, "x-priority": str(priority)},
        )
        try:
            async with self.gw.cluster.open(dispatch) as up:
                data = await up.read()
                if up.status != 200:
                    raise upstream_error(up.status, data, req.model)
        except UPSTREAM_FAULTS as exc:
            raise upstream_broken(req.model, exc) from None
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            raise upstream_error(502, b"", req.model) from None
        usage = obj.get("usage") or {}
        obj["model"] = req.model
        return orjson.dumps(obj), int(usage.get("prompt_tokens") or usage.get("total_tokens") or 0)
