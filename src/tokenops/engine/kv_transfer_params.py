"""The `kv_transfer_params` request contract of vLLM's disaggregated prefill, read and written here.

The prefill leg is sent with `{"do_remote_decode": true}` (and `max_tokens: 1`); its response carries
`{"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id", "remote_block_ids",
"remote_host", "remote_port", "remote_request_id", "tp_size": 1}`, which the decode leg sends back
unchanged. Ours adds one optional field to the prefill leg, `history: {"remote_engine_id",
"remote_host", "remote_port"}`: an engine that holds the session's earlier rounds, from which the
prefill engine pulls (by chain hash) the blocks it lacks instead of recomputing them. Anything
malformed is a 400 that names the field; whether a well-formed but stale handle still works is only
known when it is pulled (the server then prefills locally).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenops.protocol import APIError, invalid_request

PARAM = "kv_transfer_params"


@dataclass(frozen=True, slots=True)
class RemoteEngine:
    engine_id: str
    host: str
    port: int


@dataclass(frozen=True, slots=True)
class PrefillLeg:
    """Compute the prompt's KV and hold it for a decode engine (optionally pulling history first)."""

    history: RemoteEngine | None = None


@dataclass(frozen=True, slots=True)
class DecodeLeg:
    """Pull the prompt's blocks from the prefill engine that holds them, then decode."""

    source: RemoteEngine
    transfer_id: str
    block_ids: tuple[int, ...]


def _field(raw: dict[str, Any], name: str, kind: type | tuple[type, ...], where: str = PARAM) -> Any:
    value = raw.get(name)
    if value is None or isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        expected = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise invalid_request(f"{where}.{name} must be a {expected}, got {value!r}.", param=f"{where}.{name}")
    return value


def _engine(raw: dict[str, Any], where: str) -> RemoteEngine:
    port = _field(raw, "remote_port", int, where)
    if not 0 < port < 65536:
        raise invalid_request(
            f"{where}.remote_port must be a TCP port, got {port}.", param=f"{where}.remote_port"
        )
    return RemoteEngine(
        _field(raw, "remote_engine_id", str, where), _field(raw, "remote_host", str, where), port
    )


def parse(raw: Any) -> PrefillLeg | DecodeLeg | None:
    """The leg a request's `kv_transfer_params` asks for (None: a plain request). Raises `APIError`."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise invalid_request(f"{PARAM} must be an object, got {type(raw).__name__}.", param=PARAM)
    remote_decode, remote_prefill = raw.get("do_remote_decode"), raw.get("do_remote_prefill")
    for name, value in (("do_remote_decode", remote_decode), ("do_remote_prefill", remote_prefill)):
        if value is not None and not isinstance(value, bool):
            raise invalid_request(f"{PARAM}.{name} must be true or false.", param=f"{PARAM}.{name}")
    if remote_decode and remote_prefill:
        raise invalid_request(
            f"{PARAM} cannot ask for both do_remote_decode and do_remote_prefill.", param=PARAM
        )
    if remote_decode:
        history = raw.get("history")
        if history is None:
            return PrefillLeg()
        if not isinstance(history, dict):
            raise invalid_request(f"{PARAM}.history must be an object.", param=f"{PARAM}.history")
        return PrefillLeg(_engine(history, f"{PARAM}.history"))
    if remote_prefill:
        ids = _field(raw, "remote_block_ids", list)
        if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in ids):
            raise invalid_request(
                f"{PARAM}.remote_block_ids must be a list of block ids (non-negative integers).",
                param=f"{PARAM}.remote_block_ids",
            )
        return DecodeLeg(_engine(raw, PARAM), _field(raw, "remote_request_id", str), tuple(ids))
    return None


def decode_handle(engine_id: str, host: str, port: int, transfer_id: str, block_ids: tuple[int, ...]) -> dict:
    """What a prefill leg's response carries for its decode leg (vLLM's NixlConnector fields)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_host": host,
        "remote_port": port,
        "remote_request_id": transfer_id,
        "remote_block_ids": list(block_ids),
        "tp_size": 1,
    }


def role_error(role: str, leg: PrefillLeg | DecodeLeg) -> APIError | None:
    """A prefill-only engine does not take decode legs, and a decode-only one no prefill legs."""
    if role == "prefill" and isinstance(leg, DecodeLeg):
        return invalid_request(
            "This engine runs with --role prefill: it takes no decode legs (do_remote_prefill).",
            param=f"{PARAM}.do_remote_prefill",
        )
    if role == "decode" and isinstance(leg, PrefillLeg):
        return invalid_request(
            "This engine runs with --role decode: it takes no prefill legs (do_remote_decode).",
            param=f"{PARAM}.do_remote_decode",
        )
    return None
