"""The binary wire format between an attention client and expert servers (length-prefixed frames).

Every frame is a fixed 32-byte little-endian header, then a payload of `payload_len` bytes:
magic "TOEX", version, kind, dtype code, a reserved byte, request id (u64), layer (u32), rows (u32),
cols (u32), payload length (u32). Kinds:
- HELLO (client -> server, empty) / INFO (reply): rows entries of (layer u32, expert u32, 16-byte
  weight fingerprint), `cols` = hidden size, dtype = the server's compute dtype;
- COMPUTE: `rows` hidden states [rows, cols] in `dtype`, then `rows` int32 expert ids (one per row,
  the layer's global expert numbers) / RESULT: the expert outputs [rows, cols], unweighted;
- ERROR: a UTF-8 message, the error code in `layer`;
- REGISTER (server -> a client's registry): the server's address "host:port" in UTF-8 / ACCEPTED
  (empty) or ERROR `E_REFUSED` with the reason.
Tensors travel as their raw bytes, never as JSON. This module owns framing and validation only;
it opens no sockets. A frame that cannot be parsed raises `ProtocolError`, never returns a guess.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

import torch

MAGIC = b"TOEX"
VERSION = 1
HEADER = struct.Struct("<4sBBBBQIIII")
ENTRY = struct.Struct("<II16s")
# a COMPUTE frame above this is refused before its payload is read (a corrupt length must not
# make a server allocate gigabytes)
MAX_PAYLOAD = 1 << 30

HELLO, INFO, COMPUTE, RESULT, ERROR, REGISTER, ACCEPTED = 1, 2, 3, 4, 5, 6, 7
_KINDS = {HELLO, INFO, COMPUTE, RESULT, ERROR, REGISTER, ACCEPTED}

DTYPES = {0: torch.float32, 1: torch.bfloat16, 2: torch.float16}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}

# ERROR codes
E_MALFORMED, E_SHAPE, E_DTYPE, E_EXPERT, E_INTERNAL, E_REFUSED = 1, 2, 3, 4, 5, 6


class ProtocolError(ValueError):
    """A frame that does not follow the format (bad magic or version, lengths that disagree)."""


@dataclass(frozen=True)
class Frame:
    kind: int
    request_id: int
    layer: int = 0
    rows: int = 0
    cols: int = 0
    dtype: int = 0
    payload: bytes = b""

    def encode(self) -> bytes:
        return (
            HEADER.pack(
                MAGIC,
                VERSION,
                self.kind,
                self.dtype,
                0,
                self.request_id,
                self.layer,
                self.rows,
                self.cols,
                len(self.payload),
            )
            + self.payload
        )


def parse_header(data: bytes) -> tuple[int, int, int, int, int, int, int]:
    """(kind, dtype, request_id, layer, rows, cols, payload_len) of a 32-byte header, validated."""
    if len(data) != HEADER.size:
        raise ProtocolError(f"truncated header: {len(data)} of {HEADER.size} bytes")
    magic, version, kind, dtype, _, rid, layer, rows, cols, length = HEADER.unpack(data)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}: not a tokenops expert frame")
    if version != VERSION:
        raise ProtocolError(f"wire version {version}, this side speaks {VERSION}")
    if kind not in _KINDS:
        raise ProtocolError(f"unknown frame kind {kind}")
    if length > MAX_PAYLOAD:
        raise ProtocolError(f"payload of {length} bytes exceeds the {MAX_PAYLOAD}-byte limit")
    return kind, dtype, rid, layer, rows, cols, length


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            if got == 0:
                raise EOFError("connection closed")
            raise ProtocolError(f"truncated frame: connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def read_frame(sock: socket.socket) -> Frame:
    """The next frame on `sock`. EOFError on a clean close between frames, ProtocolError on a bad
    or truncated one (the stream is then out of step: close the connection)."""
    kind, dtype, rid, layer, rows, cols, length = parse_header(_recv_exact(sock, HEADER.size))
    payload = _recv_exact(sock, length) if length else b""
    return Frame(kind, rid, layer, rows, cols, dtype, payload)


def compute_frame(request_id: int, layer: int, x: torch.Tensor, expert_ids: torch.Tensor) -> Frame:
    code = DTYPE_CODES.get(x.dtype)
    if code is None:
        raise ValueError(f"dtype {x.dtype} has no wire code")
    payload = _tensor_bytes(x) + _tensor_bytes(expert_ids.to(torch.int32))
    return Frame(COMPUTE, request_id, layer, x.shape[0], x.shape[1], code, payload)


def decode_compute(frame: Frame) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden [rows, cols], expert ids [rows]) of a COMPUTE frame; ProtocolError if the payload
    length does not match its rows, cols and dtype."""
    dtype = _dtype(frame.dtype)
    size = frame.rows * frame.cols * _itemsize(dtype)
    if len(frame.payload) != size + 4 * frame.rows:
        raise ProtocolError(
            f"COMPUTE payload of {len(frame.payload)} bytes, rows {frame.rows} x cols {frame.cols} "
            f"of {dtype} need {size + 4 * frame.rows}"
        )
    x = _tensor(frame.payload[:size], dtype).view(frame.rows, frame.cols)
    ids = _tensor(frame.payload[size:], torch.int32)
    return x, ids


def result_frame(request_id: int, layer: int, y: torch.Tensor) -> Frame:
    return Frame(RESULT, request_id, layer, y.shape[0], y.shape[1], DTYPE_CODES[y.dtype], _tensor_bytes(y))


def decode_result(frame: Frame, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """The RESULT tensor, checked against what was asked (rows, cols, dtype)."""
    if (frame.rows, frame.cols) != (rows, cols) or DTYPES.get(frame.dtype) != dtype:
        raise ProtocolError(
            f"RESULT is [{frame.rows}, {frame.cols}] code {frame.dtype}, asked [{rows}, {cols}] {dtype}"
        )
    if len(frame.payload) != rows * cols * _itemsize(dtype):
        raise ProtocolError(f"RESULT payload of {len(frame.payload)} bytes for [{rows}, {cols}] {dtype}")
    return _tensor(frame.payload, dtype).view(rows, cols)


def info_frame(
    request_id: int, hidden: int, dtype: torch.dtype, entries: list[tuple[int, int, bytes]]
) -> Frame:
    payload = b"".join(ENTRY.pack(layer, expert, fp) for layer, expert, fp in entries)
    return Frame(INFO, request_id, 0, len(entries), hidden, DTYPE_CODES[dtype], payload)


def decode_info(frame: Frame) -> tuple[int, torch.dtype, list[tuple[int, int, bytes]]]:
    if frame.kind != INFO or len(frame.payload) != frame.rows * ENTRY.size:
        raise ProtocolError("not a well-formed INFO frame")
    entries = [ENTRY.unpack_from(frame.payload, i * ENTRY.size) for i in range(frame.rows)]
    return frame.cols, _dtype(frame.dtype), entries


def error_frame(request_id: int, code: int, message: str) -> Frame:
    return Frame(ERROR, request_id, code, 0, 0, 0, message.encode("utf-8")[:4096])


def _dtype(code: int) -> torch.dtype:
    dtype = DTYPES.get(code)
    if dtype is None:
        raise ProtocolError(f"unknown dtype code {code}")
    return dtype


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().cpu()
    # bf16 has no numpy dtype: move its bits as int16
    raw = t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t
    return raw.numpy().tobytes()


def _tensor(data: bytes, dtype: torch.dtype) -> torch.Tensor:
    if not data:
        return torch.empty(0, dtype=dtype)
    if dtype in (torch.bfloat16, torch.float16):
        return torch.frombuffer(bytearray(data), dtype=torch.int16).view(dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype)
