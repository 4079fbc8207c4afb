"""Where a model spec's files are, and what the engine and the gateway read from them without torch.

- `resolve_model(spec)`: a bundled name, a Hugging Face folder or a .gguf file (or a folder holding
  one) as a `ModelSource` (name, path, kind). The engine's loader and the gateway's prompt tokeniser
  both call it, so both read the same file for the same spec.
- `file_sha256`: the file's sha256, which keys every cache entry of a GGUF file.
- `parse_gguf`: the GGUF header (metadata, tensor views), parsed directly (gguf-py's GGUFReader builds
  numpy views for every string of a vocabulary and takes ~20 s on Gemma's 262k tokens).
- `gguf_tokenizer`: the tokenizer a GGUF file describes, from the tokenizer cache
  `<cache_dir>/gguf-tokenizer/<sha256>-v<TOKENIZER_FORMAT>/` (tokenizer.json, written by the
  `tokenizers` library and loaded with `Tokenizer.from_file`, plus tokenops.json: the special ids,
  the chat template, and a sha256 of both files). Rebuilding from the metadata takes seconds
  (Gemma's 262k-token vocabulary with 515k merges); reading the entry about a second. An entry
  that does not match its recorded sha256, that does not load, or that another format version or
  `tokenizers` version wrote is rebuilt, never trusted; an unwritable cache only warns.

Nothing here imports torch (the gateway imports this module); reading weights is `gguf_reader`'s.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import tokenizers

from tokenops.engine.bundled import BUNDLED, DEFAULT_MODEL, expected_sha256, is_bundled, resolve_bundled
from tokenops.engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    import numpy as np

# bump when the GGUF tokenizer rebuild (tokenizer.from_gguf_metadata) or the entry's files change
TOKENIZER_FORMAT = 1


class ModelNotFoundError(ValueError):
    """The spec names neither a bundled model nor an existing folder or .gguf file."""


@dataclass(frozen=True)
class ModelSource:
    """A resolved model spec: `kind` "gguf" (path: the .gguf file) or "hf" (path: the folder)."""

    name: str
    path: Path
    kind: Literal["gguf", "hf"]


def resolve_model(spec: str | None, cache_dir: Path | None = None) -> ModelSource:
    """The files behind `spec`: a bundled name (its GGUF file, assembled into `cache_dir` where needed
    and checked against the package's sha256), a folder (a HF folder, unless it has no config.json
    and holds exactly one .gguf file) or a .gguf file. Raises `ModelNotFoundError`."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    spec = spec or DEFAULT_MODEL
    if is_bundled(spec):
        path = resolve_bundled(spec, cache_dir)
        want = expected_sha256(spec)
        if want and file_sha256(path) != want:  # a damaged copy in our cache: assemble it again
            path.unlink()
            path = resolve_bundled(spec, cache_dir)
        return ModelSource(spec, path, "gguf")
    path = Path(spec).expanduser()
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").is_file() and len(ggufs) == 1:  # a folder holding one GGUF file
            return ModelSource(ggufs[0].stem, ggufs[0], "gguf")
        return ModelSource(path.name, path, "hf")
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.stem, path, "gguf")
    raise ModelNotFoundError(
        f"model {spec!r} is neither a bundled model ({', '.join(sorted(BUNDLED))}), "
        "nor a folder with config.json, nor a .gguf file"
    )


# --- GGUF files ---------------------------------------------------------------------------------


_HASHES: dict[tuple[str, int, int], str] = {}


def file_sha256(path: Path) -> str:
    """sha256 of a file, remembered per (path, size, mtime) for the life of the process."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _HASHES:
        digest = hashlib.sha256()
        with path.open("rb") as f:
            while block := f.read(8 << 20):
                digest.update(block)
        _HASHES[key] = digest.hexdigest()
    return _HASHES[key]


def default_cache_dir() -> Path:
    """$TOKENOPS_CACHE_DIR, else ~/.cache/tokenops."""
    env = os.environ.get("TOKENOPS_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tokenops"



@dataclass
class GGUFTensor:
    """One tensor of a GGUF file: its llama.cpp name, ggml type, dims (fastest first) and raw data view."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray  # typed for F32/F16/BF16..., uint8 rows of blocks for quantised types


# GGUF metadata value types -> struct format (8 = string, 9 = array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}


def parse_gguf(path: Path, vocabulary: bool = True) -> tuple[dict[str, Any], list[GGUFTensor]]:
    """Metadata and tensor views of a GGUF (v2/v3, little-endian) file.

    A direct parser rather than gguf-py's GGUFReader: that one builds numpy views for every
    string of a vocabulary and takes ~20 s on Gemma's 262k tokens; this reads them in one pass.
    `vocabulary=False` steps over arrays of strings (tokens, merges) without decoding them, their
    value None: for a caller whose tokenizer is cached (0.5 s less on Gemma).
    """
    import struct

    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    buf = np.memmap(path, dtype=np.uint8, mode="r")
    mv = memoryview(buf)
    if bytes(mv[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", mv, 4)
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} is not supported (need 2 or later)")
    pos = 24

    def read_str() -> str:
        nonlocal pos
        (n,) = struct.unpack_from("<Q", mv, pos)
        pos += 8
        out = bytes(mv[pos : pos + n]).decode("utf-8", errors="replace")
        pos += n
        return out

    def read_value(vtype: int) -> Any:
        nonlocal pos
        if vtype == 8:
            return read_str()
        if vtype == 9:
            itype, count = struct.unpack_from("<IQ", mv, pos)
            pos += 12
            if itype == 8 and not vocabulary:
                for _ in range(count):
                    pos += 8 + struct.unpack_from("<Q", mv, pos)[0]
                return None
            if itype == 8:
                return [read_str() for _ in range(count)]
            if itype == 9:
                return [read_value(9) for _ in range(count)]
            arr = np.frombuffer(mv, dtype=_NP_SCALARS[itype], count=count, offset=pos)
            pos += arr.nbytes
            return arr.tolist()
        fmt = _SCALARS[vtype]
        (value,) = struct.unpack_from(fmt, mv, pos)
        pos += struct.calcsize(fmt)
        return value

    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = read_str()
        (vtype,) = struct.unpack_from("<I", mv, pos)
        pos += 4
        meta[key] = read_value(vtype)

    infos = []
    for _ in range(n_tensors):
        name = read_str()
        (n_dims,) = struct.unpack_from("<I", mv, pos)
        pos += 4
        dims = struct.unpack_from(f"<{n_dims}Q", mv, pos)
        pos += 8 * n_dims
        ttype, offset = struct.unpack_from("<IQ", mv, pos)
        pos += 12
        infos.append((name, dims, ttype, offset))
    alignment = int(meta.get("general.alignment", 32))
    data_start = -(-pos // alignment) * alignment

    plain = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}
    tensors = []
    for name, dims, ttype, offset in infos:
        qtype = GGMLQuantizationType(ttype)
        block, type_size = GGML_QUANT_SIZES[qtype]
        n_elems = int(np.prod(dims))
        n_bytes = n_elems * type_size // block
        start = data_start + offset
        np_dims = tuple(reversed(dims))
        if qtype in plain:
            data = buf[start : start + n_bytes].view(plain[qtype]).reshape(np_dims)
        else:  # rows of quantised blocks, the layout gguf.quants.dequantize expects
            data = buf[start : start + n_bytes].reshape(*np_dims[:-1], np_dims[-1] // block * type_size)
        tensors.append(GGUFTensor(name=name, tensor_type=qtype, shape=tuple(dims), data=data))
    return meta, tensors



# --- the tokenizer cache ------------------------------------------------------------------------


def tokenizer_entry(cache_dir: Path, sha: str) -> Path:
    """Where the tokenizer of the GGUF file with this sha256 is cached."""
    return Path(cache_dir) / "gguf-tokenizer" / f"{sha}-v{TOKENIZER_FORMAT}"


def gguf_tokenizer(
    path: Path, cache_dir: Path | None = None, meta: dict[str, Any] | None = None, use_cache: bool = True
) -> Tokenizer:
    """The tokenizer of a GGUF file: from the tokenizer cache, else rebuilt from the file's metadata
    (`meta` when the caller parsed it already) and cached."""
    path = Path(path)
    sha = file_sha256(path)
    entry = tokenizer_entry(cache_dir or default_cache_dir(), sha)
    if use_cache:
        cached = _read_tokenizer_entry(entry, sha)
        if cached is not None:
            return cached
    if meta is None or meta.get("tokenizer.ggml.tokens") is None:
        meta = parse_gguf(path)[0]
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    if use_cache:
        try:
            _write_tokenizer_entry(entry, sha, tokenizer)
        except OSError as exc:  # the tokenizer is built: a cache that cannot be written costs the next start only
            warnings.warn(f"could not write the tokenizer cache entry {entry}: {exc}", stacklevel=2)
    return tokenizer


def _read_tokenizer_entry(entry: Path, sha: str) -> Tokenizer | None:
    """The cached tokenizer, or None when there is none; a damaged or stale entry is removed (to be rebuilt)."""
    info_path = entry / "tokenops.json"
    if not info_path.is_file():
        return None
    try:
        info = json.loads(info_path.read_text(encoding="utf-8"))
        digest = info.pop("entry_sha256")
        if info.get("format") != TOKENIZER_FORMAT or info.get("tokenizers") != tokenizers.__version__:
            raise ValueError(f"written by format {info.get('format')} / tokenizers {info.get('tokenizers')}")
        if info.get("gguf_sha256") != sha:
            raise ValueError(f"written for the GGUF file {info.get('gguf_sha256')}")
        file = entry / "tokenizer.json"
        if _entry_digest(file.read_bytes(), info) != digest:
            raise ValueError("tokenizer.json or tokenops.json does not match the recorded sha256")
        return Tokenizer.from_files(file, info)
    except Exception as exc:  # noqa: BLE001 - whatever is wrong with it (JSON, keys, the Rust loader): rebuild
        warnings.warn(f"tokenizer cache entry {entry} is damaged or stale ({exc}); rebuilding it", stacklevel=3)
        shutil.rmtree(entry, ignore_errors=True)
        return None


def _write_tokenizer_entry(entry: Path, sha: str, tokenizer: Tokenizer) -> None:
    """Write the entry into a temporary folder and rename it into place (tokenops.json last: it marks
    a complete entry), so a crash or a concurrent writer never leaves a half-written one."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry.parent / f".{entry.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        info = tokenizer.write_files(tmp / "tokenizer.json")
        info.update(format=TOKENIZER_FORMAT, tokenizers=tokenizers.__version__, gguf_sha256=sha)
        info["entry_sha256"] = _entry_digest((tmp / "tokenizer.json").read_bytes(), info)
        (tmp / "tokenops.json").write_text(json.dumps(info, indent=1), encoding="utf-8")
        shutil.rmtree(entry, ignore_errors=True)  # a stale entry (its reader removed it already) or a race
        try:
            os.rename(tmp, entry)
        except OSError:  # another process finished the same entry first
            if not (entry / "tokenops.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _entry_digest(tokenizer_json: bytes, info: dict[str, Any]) -> str:
    """sha256 of tokenizer.json and of everything tokenops.json records beside it."""
    digest = hashlib.sha256(tokenizer_json)
    digest.update(json.dumps(info, sort_keys=True).encode("utf-8"))
    return digest.hexdigest()
