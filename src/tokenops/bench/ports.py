"""Free loopback ports for the servers that benchmarks and tests start."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A loopback port nothing listens on now (the OS's pick; a racing process could still take it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> list[int]:
    """`n` consecutive free loopback ports (a gateway's embedded engines take consecutive ports)."""
    for _ in range(100):
        base = free_port()
        if base + n > 65535:
            continue
        ports = list(range(base, base + n))
        if all(_is_free(p) for p in ports):
            return ports
    raise RuntimeError(f"no {n} consecutive free loopback ports")


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True
