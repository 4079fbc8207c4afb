"""Lets llama-cpp-py-sync's prebuilt libraries load on glibc < 2.38 (Debian 12 has 2.36).

The wheel is tagged manylinux2014 but its libraries were linked against glibc 2.38, and the only
symbols they take from 2.38 are the C23 flavours of strtol / strtoul / strtoull / sscanf
(`__isoc23_strtol@GLIBC_2.38`, ...), which differ from the classic ones only in accepting "0b"
binary literals. The loader refuses such a library before anything runs:
"version `GLIBC_2.38' not found". This rewrites each such import in place to the classic symbol
(`__isoc23_strtol` -> `strtol`, the same string 9 bytes further on in .dynstr) at the library's
baseline libc version (GLIBC_2.2.5), and marks the then unused GLIBC_2.38 requirement weak so that
the loader's version check passes. Nothing else in the file changes; llama.cpp's compute kernels
are untouched. A library without GLIBC_2.38 imports is left as it is.

Run:  python benchmarks/llamacpp_glibc_compat.py VENV_PYTHON   (the Makefile's bench-llamacpp-env does)
"""

from __future__ import annotations

import platform
import struct
import subprocess
import sys
from pathlib import Path

VER_FLG_WEAK = 0x2


def _sections(data: bytes) -> dict[str, tuple[int, int, int]]:
    """Section name -> (file offset, size, entry size), for a little-endian ELF64 file."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a little-endian ELF64 file")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]
    out = {}
    for name, _type, _flags, _addr, offset, size, _link, _info, _align, entsize in headers:
        end = data.index(b"\0", names_at + name)
        out[data[names_at + name : end].decode()] = (offset, size, entsize)
    return out


def _cstr(data: bytes, at: int) -> bytes:
    return data[at : data.index(b"\0", at)]


def patch(path: Path, version: bytes = b"GLIBC_2.38", prefix: bytes = b"__isoc23_") -> int:
    """Rewrites one library's libc imports at `version` named `prefix`+NAME to NAME@GLIBC_2.2.5;
    returns how many symbols changed."""
    data = bytearray(path.read_bytes())
    sec = _sections(data)
    if ".gnu.version_r" not in sec:
        return 0
    strtab = sec[".dynstr"][0]
    # find libc's GLIBC_2.38 and GLIBC_2.2.5 requirements (Elf64_Verneed / Elf64_Vernaux chains)
    new_aux = base_index = new_index = None
    at = sec[".gnu.version_r"][0]
    while True:
        _ver, count, file_, aux, next_ = struct.unpack_from("<HHIII", data, at)
        if _cstr(data, strtab + file_) == b"libc.so.6":
            a = at + aux
            for _ in range(count):
                _hash, _flags, other, name, anext = struct.unpack_from("<IHHII", data, a)
                needed = _cstr(data, strtab + name)
                if needed == version:
                    new_aux, new_index = a, other & 0x7FFF
                elif needed == b"GLIBC_2.2.5":
                    base_index = other & 0x7FFF
                a += anext
        if not next_:
            break
        at += next_
    if new_aux is None:
        return 0
    if base_index is None:
        raise ValueError(f"{path}: no GLIBC_2.2.5 requirement to move the {prefix.decode()} imports to")
    symtab, symsize, symentsize = sec[".dynsym"]
    versym = sec[".gnu.version"][0]
    changed = 0
    for i in range(symsize // symentsize):
        if struct.unpack_from("<H", data, versym + 2 * i)[0] & 0x7FFF != new_index:
            continue
        sym = symtab + i * symentsize
        (name,) = struct.unpack_from("<I", data, sym)
        full = _cstr(data, strtab + name)
        if not full.startswith(prefix):
            raise ValueError(
                f"{path}: {full.decode()} needs {version.decode()} and has no older equivalent here"
            )
        struct.pack_into("<I", data, sym, name + len(prefix))  # "__isoc23_strtol" -> "strtol"
        struct.pack_into("<H", data, versym + 2 * i, base_index)
        changed += 1
    (flags,) = struct.unpack_from("<H", data, new_aux + 4)
    if not changed and flags & VER_FLG_WEAK:
        return 0  # patched before
    struct.pack_into("<H", data, new_aux + 4, flags | VER_FLG_WEAK)
    path.write_bytes(data)
    return changed


def imported_names(path: Path) -> set[str]:
    """Names of the undefined (imported) dynamic symbols of a library."""
    data = path.read_bytes()
    sec = _sections(data)
    strtab = sec[".dynstr"][0]
    symtab, symsize, symentsize = sec[".dynsym"]
    names = set()
    for i in range(1, symsize // symentsize):
        name, _info, _other, shndx = struct.unpack_from("<IBBH", data, symtab + i * symentsize)
        if shndx == 0:
            names.add(_cstr(data, strtab + name).decode())
    return names


def glibc_version() -> tuple[int, ...]:
    name, version = platform.libc_ver()
    return tuple(int(x) for x in version.split(".")) if name == "glibc" else (0,)


def main() -> None:
    python = sys.argv[1] if len(sys.argv) > 1 else sys.executable
    if glibc_version() >= (2, 38):
        print("glibc >= 2.38: llama-cpp-py-sync's libraries load as shipped")
        return
    package = subprocess.run(
        [
            python,
            "-c",
            "import importlib.util as u; "
            "print(u.find_spec('llama_cpp_py_sync').submodule_search_locations[0])",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    for lib in sorted(Path(package).glob("lib*.so*")):
        n = patch(lib)
        if n:
            print(f"{lib.name}: {n} C23 imports moved from GLIBC_2.38 to GLIBC_2.2.5")


if __name__ == "__main__":
    main()
