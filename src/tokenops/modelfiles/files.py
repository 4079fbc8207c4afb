"""Where a model spec's files are, and what the engine and the gateway read from them without torch.

- `resolve_model(spec)`: a bundled name, a Hugging Face folder or a .gguf file (or a folder holding
  one) as a `ModelSource` (name, path, kind). The engine's loader and the gateway's prompt tokeniser
  both call it, so both read the same file for the same spec.
- `file_sha256`: the file's sha256, which keys the engine's weight cache entries of a GGUF file.
- `GGUFHeader` / `parse_gguf`: the GGUF header (metadata, tensor infos, where the tensor data starts),
  parsed directly from a memory map (gguf-py's GGUFReader builds numpy views for every string of a
  vocabulary, far too slow on large vocabularies), and the tensors as views of the mapped file.
- `gguf_tokenizer`: the tokenizer a GGUF file describes, from the tokenizer cache
  `<cache_dir>/gguf-tokenizer/<header sha256>-v<TOKENIZER_FORMAT>-tokenizers<version>/`
  (tokenizer.json, written by the `tokenizers` library and loaded with `Tokenizer.from_file`, plus
  tokenops.json: the special ids, the chat template, and a sha256 of both files). The entry is keyed
  by a sha256 of the file's header alone (the tokenizer depends on the metadata only), so getting a
  tokenizer reads the header and never the tensor data: the gateway reads no more of a large file
  than its metadata. Reading the entry is much cheaper than rebuilding from the metadata (large
  vocabularies have hundreds of thousands of merges). An entry that does not match its recorded sha256
  or does not load is removed and rebuilt, never trusted; a writer that finds a complete entry in
  place keeps it and discards its own; an unwritable cache only warns.

Nothing here imports torch (the gateway imports this module); reading weights is the engine's
`gguf_reader`'s.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import tokenizers

from tokenops.modelfiles.bundled import BUNDLED, DEFAULT_MODEL, expected_sha256, is_bundled, resolve_bundled
from tokenops.modelfiles.tokenizer import Tokenizer

if TYPE_CHECKING:
    import numpy as np

# bump when the GGUF tokenizer rebuild (tokenizer.from_gguf_metadata) or the entry's files change
TOKENIZER_FORMAT = 1
# the rebuild held by the tokenizer.json of weight entries written before the tokenizer had its own
# cache: read while TOKENIZER_FORMAT is still this one
_LEGACY_FORMAT = 1


class ModelNotFoundError(ValueError):
    """The spec names neither a bundled model nor an existing folder or .gguf file."""


@dataclass(frozen=True)
class ModelSource:
    """A resolved model spec: `kind` "gguf" (path: the .gguf file) or "hf" (path: the folder)."""

    name: str
    path: Path
    kind: Literal["gguf", "hf"]


def resolve_model(spec: str | None, cache_dir: Path | None = None, verify: bool = True) -> ModelSource:
    """The files behind `spec`: a bundled name (its GGUF file, assembled into `cache_dir` where needed
    and checked against the package's sha256), a folder (a HF folder, unless it has no config.json
    and holds exactly one .gguf file) or a .gguf file. Raises `ModelNotFoundError`.

    `verify=False` skips the bundled file's sha256 (reading the whole file) and its re-assembly: for
    a reader of the header only (the gateway), which leaves a damaged copy to the engine."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    spec = spec or DEFAULT_MODEL
    if is_bundled(spec):
        path = resolve_bundled(spec, cache_dir)
        want = expected_sha256(spec) if verify else None
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
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_NP_SCALARS = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}


class GGUFHeader:
    """The header of a GGUF (v2/v3, little-endian) file: everything before the tensor data.

    Read from a memory map: the header's pages are all that building one touches, whatever
    the file's size (the gateway reads a tokenizer this way). `vocabulary=False` steps over top-level
    arrays of strings (tokens, merges) without decoding them, their value None in `meta`;
    `vocabulary_meta()` decodes them from the positions noted on the way, without a second walk.
    """

    def __init__(self, path: Path, vocabulary: bool = True) -> None:
        import numpy as np

        self.path = Path(path)
        self._buf = np.memmap(self.path, dtype=np.uint8, mode="r")
        mv = memoryview(self._buf)
        if bytes(mv[:4]) != b"GGUF":
            raise ValueError(f"{self.path} is not a GGUF file")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", mv, 4)
        if version < 2:
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (need 2 or later)")
        self._skipped: dict[
            str, tuple[int, int]
        ] = {}  # key -> (position, count) of an undecoded string array
        self._full_meta: dict[str, Any] | None = None
        self._sha256: str | None = None
        pos = 24
        self.meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key, pos = _read_str(mv, pos)
            (vtype,) = struct.unpack_from("<I", mv, pos)
            pos += 4
            if vtype == 9 and not vocabulary:
                itype, count = struct.unpack_from("<IQ", mv, pos)
                if itype == 8:
                    self._skipped[key] = (pos + 12, count)
                    pos += 12
                    for _ in range(count):
                        pos += 8 + struct.unpack_from("<Q", mv, pos)[0]
                    self.meta[key] = None
                    continue
            self.meta[key], pos = _read_value(mv, pos, vtype)
        self.tensor_infos: list[tuple[str, tuple[int, ...], int, int]] = []  # name, dims, ggml type, offset
        for _ in range(n_tensors):
            name, pos = _read_str(mv, pos)
            (n_dims,) = struct.unpack_from("<I", mv, pos)
            pos += 4
            dims = struct.unpack_from(f"<{n_dims}Q", mv, pos)
            pos += 8 * n_dims
            ttype, offset = struct.unpack_from("<IQ", mv, pos)
            pos += 12
            self.tensor_infos.append((name, dims, ttype, offset))
        alignment = int(self.meta.get("general.alignment", 32))
        self.data_start = -(-pos // alignment) * alignment  # the tensor data begins here

    def sha256(self) -> str:
        """sha256 of the header's bytes (metadata, tensor infos, padding): keys the tokenizer cache,
        which depends on the metadata alone, without reading the tensor data."""
        if self._sha256 is None:
            self._sha256 = hashlib.sha256(self._buf[: self.data_start]).hexdigest()
        return self._sha256

    def vocabulary_meta(self) -> dict[str, Any]:
        """`meta` with the string arrays stepped over decoded."""
        if self._full_meta is None:
            mv = memoryview(self._buf)
            self._full_meta = dict(self.meta)
            for key, (pos, count) in self._skipped.items():
                strings = []
                for _ in range(count):
                    s, pos = _read_str(mv, pos)
                    strings.append(s)
                self._full_meta[key] = strings
        return self._full_meta

    def tensors(self) -> list[GGUFTensor]:
        """Views of the tensors in the mapped file (nothing is read until a view is)."""
        import numpy as np
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        plain = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}
        tensors = []
        for name, dims, ttype, offset in self.tensor_infos:
            qtype = GGMLQuantizationType(ttype)
            block, type_size = GGML_QUANT_SIZES[qtype]
            n_elems = int(np.prod(dims))
            n_bytes = n_elems * type_size // block
            start = self.data_start + offset
            np_dims = tuple(reversed(dims))
            if start + n_bytes > len(self._buf):
                raise ValueError(f"{self.path}: tensor {name!r} runs past the end of the file")
            if qtype in plain:
                data = self._buf[start : start + n_bytes].view(plain[qtype]).reshape(np_dims)
            else:  # rows of quantised blocks, the layout gguf.quants.dequantize expects
                data = self._buf[start : start + n_bytes].reshape(
                    *np_dims[:-1], np_dims[-1] // block * type_size
                )
            tensors.append(GGUFTensor(name=name, tensor_type=qtype, shape=tuple(dims), data=data))
        return tensors


def _read_str(mv: memoryview, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", mv, pos)
    pos += 8
    return bytes(mv[pos : pos + n]).decode("utf-8", errors="replace"), pos + n


def _read_value(mv: memoryview, pos: int, vtype: int) -> tuple[Any, int]:
    import numpy as np

    if vtype == 8:
        return _read_str(mv, pos)
    if vtype == 9:
        itype, count = struct.unpack_from("<IQ", mv, pos)
        pos += 12
        if itype in (8, 9):
            out = []
            for _ in range(count):
                value, pos = _read_value(mv, pos, itype)
                out.append(value)
            return out, pos
        arr = np.frombuffer(mv, dtype=_NP_SCALARS[itype], count=count, offset=pos)
        return arr.tolist(), pos + arr.nbytes
    fmt = _SCALARS[vtype]
    (value,) = struct.unpack_from(fmt, mv, pos)
    return value, pos + struct.calcsize(fmt)


def parse_gguf(path: Path, vocabulary: bool = True) -> tuple[dict[str, Any], list[GGUFTensor]]:
    """Metadata and tensor views of a GGUF (v2/v3, little-endian) file (`GGUFHeader`).

    A direct parser rather than gguf-py's GGUFReader: that one builds numpy views for every
    string of a vocabulary, far too slow on large vocabularies; this reads them in one pass.
    `vocabulary=False` steps over arrays of strings (tokens, merges) without decoding them, their
    value None: for a caller whose tokenizer is cached.
    """
    header = GGUFHeader(path, vocabulary)
    return header.meta, header.tensors()


# --- the tokenizer cache ------------------------------------------------------------------------


def tokenizer_entry(cache_dir: Path, header_sha: str) -> Path:
    """Where the tokenizer of a GGUF file whose header has this sha256 is cached. The name holds
    everything that makes an entry another install's (format, `tokenizers` version), so installs
    that share a cache keep an entry each rather than replacing one another's."""
    name = f"{header_sha}-v{TOKENIZER_FORMAT}-tokenizers{tokenizers.__version__}"
    return Path(cache_dir) / "gguf-tokenizer" / name


def gguf_tokenizer(
    path: Path,
    cache_dir: Path | None = None,
    header: GGUFHeader | None = None,
    use_cache: bool = True,
    legacy: Sequence[Path] = (),
) -> Tokenizer:
    """The tokenizer of a GGUF file: from the tokenizer cache, else rebuilt from the file's metadata
    and cached. Reads the file's header only (`header` when the caller parsed it already).

    `legacy`: tokenizer.json files of weight entries written before the tokenizer had its own cache
    (`gguf_reader` names them); on a miss the first that loads is used, and cached."""
    header = header if header is not None else GGUFHeader(path, vocabulary=False)
    sha = header.sha256()
    entry = tokenizer_entry(cache_dir or default_cache_dir(), sha)
    tokenizer = None
    if use_cache:
        tokenizer = _read_tokenizer_entry(entry, sha)
        if tokenizer is not None:
            return tokenizer
        if TOKENIZER_FORMAT == _LEGACY_FORMAT:
            tokenizer = next((t for t in map(_read_legacy_tokenizer, legacy) if t is not None), None)
    if tokenizer is None:
        tokenizer = Tokenizer.from_gguf_metadata(header.vocabulary_meta())
    if use_cache:
        try:
            _write_tokenizer_entry(entry, sha, tokenizer)
        except Exception as exc:  # noqa: BLE001 - the tokenizer is built: a cache that cannot be written (OSError,
            # or the tokenizers library's plain Exception) costs the next start only
            warnings.warn(f"could not write the tokenizer cache entry {entry}: {exc}", stacklevel=2)
    return tokenizer


def _read_tokenizer_entry(entry: Path, sha: str) -> Tokenizer | None:
    """The cached tokenizer, or None when there is none; a damaged entry is removed (to be rebuilt)."""
    if not entry.exists():
        return None
    try:
        # a writer renames a complete entry into place, so a folder without tokenops.json is damaged
        info = json.loads((entry / "tokenops.json").read_text(encoding="utf-8"))
        digest = info.pop("entry_sha256")
        if info.get("format") != TOKENIZER_FORMAT or info.get("tokenizers") != tokenizers.__version__:
            raise ValueError(f"written by format {info.get('format')} / tokenizers {info.get('tokenizers')}")
        if info.get("gguf_header_sha256") != sha:
            raise ValueError(f"written for the GGUF header {info.get('gguf_header_sha256')}")
        file = entry / "tokenizer.json"
        if _entry_digest(file.read_bytes(), info) != digest:
            raise ValueError("tokenizer.json or tokenops.json does not match the recorded sha256")
        return Tokenizer.from_files(file, info)
    except Exception as exc:  # noqa: BLE001 - whatever is wrong with it (JSON, keys, the Rust loader): rebuild
        warnings.warn(
            f"tokenizer cache entry {entry} is damaged or stale ({exc}); rebuilding it", stacklevel=3
        )
        shutil.rmtree(entry, ignore_errors=True)
        return None


def _write_tokenizer_entry(entry: Path, sha: str, tokenizer: Tokenizer) -> None:
    """Write the entry into a temporary folder of its own and rename it into place, so a crash never
    leaves a half-written entry and concurrent writers (threads or processes) never share a folder.
    A complete entry already there (another writer's) is kept and ours discarded: a reader may be
    loading it; only a reader removes an entry, one it found damaged."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=entry.parent, prefix=f".{entry.name}."))
    try:
        info = tokenizer.write_files(tmp / "tokenizer.json")
        info.update(format=TOKENIZER_FORMAT, tokenizers=tokenizers.__version__, gguf_header_sha256=sha)
        info["entry_sha256"] = _entry_digest((tmp / "tokenizer.json").read_bytes(), info)
        (tmp / "tokenops.json").write_text(json.dumps(info, indent=1), encoding="utf-8")
        if (entry / "tokenops.json").is_file():
            return  # another writer finished first
        try:
            os.rename(tmp, entry)  # fails on an entry that is there and not empty
        except OSError:
            if not (entry / "tokenops.json").is_file():  # not another writer's entry: say so
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _read_legacy_tokenizer(file: Path) -> Tokenizer | None:
    """The tokenizer.json a weight entry held before the tokenizer had its own cache, trusted as the
    code that wrote it trusted it: complete when the entry's model.json is there, and it must load.
    Never removed (the entry holds weights); None when absent or unreadable."""
    if not ((file.parent / "model.json").is_file() and file.is_file()):
        return None
    try:
        return Tokenizer.from_dict(json.loads(file.read_text(encoding="utf-8")))
    except Exception as exc:  # noqa: BLE001 - JSON, keys, the Rust loader: rebuild instead
        warnings.warn(
            f"the tokenizer of the older cache entry {file.parent} does not load ({exc})", stacklevel=4
        )
        return None


def _entry_digest(tokenizer_json: bytes, info: dict[str, Any]) -> str:
    """sha256 of tokenizer.json and of everything tokenops.json records beside it."""
    digest = hashlib.sha256(tokenizer_json)
    digest.update(json.dumps(info, sort_keys=True).encode("utf-8"))
    return digest.hexdigest()
