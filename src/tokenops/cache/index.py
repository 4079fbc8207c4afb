"""Where cache entries live: the entry type, the index interface, and the in-process index.

This module owns `CacheEntry` (one stored answer with its scope, keys, prompt text and embedding), the
`CacheIndex` interface that the cache façade calls (exact get, nearest within a scope, put, remove),
and `MemoryIndex`, the default: a dict of entries in LRU order plus, per scope, a numpy matrix of unit
vectors searched by brute-force cosine (a matrix-vector product; scopes hold thousands of entries at
most, where that is faster than any ANN structure). It enforces the TTL (lazily on access and by a
sweep at each put) and the memory bound (entries and bytes, least recently used first). It does not
decide what may be cached or served (scope.py, guards.py, cache.py do). The shared Redis index is in
redis_index.py.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import orjson

# bookkeeping per entry beyond its payload: ids, keys, timestamps, dict slots (a measured rough figure)
ENTRY_OVERHEAD_BYTES = 400


@dataclass(slots=True, eq=False)
class CacheEntry:
    """One stored answer, reusable only inside its scope."""

    id: str
    tenant: str
    scope_hash: str
    exact_key: str
    text: str | None  # the last user message, when the semantic layer may match it
    response: bytes  # the whole completion as JSON
    created_at: float
    expires_at: float
    vector: np.ndarray | None = None  # unit float32 embedding of `text`

    @property
    def size(self) -> int:
        text = len(self.text.encode("utf-8")) if self.text else 0
        vec = self.vector.nbytes if self.vector is not None else 0
        return len(self.response) + text + vec + ENTRY_OVERHEAD_BYTES

    def record(self) -> bytes:
        """The entry without its vector, as JSON (the shared index keeps vectors apart)."""
        return orjson.dumps(
            {
                "id": self.id,
                "tenant": self.tenant,
                "scope": self.scope_hash,
                "exact": self.exact_key,
                "text": self.text,
                "response": orjson.Fragment(self.response),
                "created_at": self.created_at,
                "expires_at": self.expires_at,
            }
        )

    @classmethod
    def from_record(cls, raw: bytes | str, vector: np.ndarray | None = None) -> CacheEntry:
        d: dict[str, Any] = orjson.loads(raw)
        return cls(
            id=d["id"],
            tenant=d["tenant"],
            scope_hash=d["scope"],
            exact_key=d["exact"],
            text=d["text"],
            response=orjson.dumps(d["response"]),
            created_at=d["created_at"],
            expires_at=d["expires_at"],
            vector=vector,
        )


@dataclass(slots=True)
class Evictions:
    """Entries removed by a put: past their TTL, or least recently used beyond the memory bound."""

    expired: int = 0
    capacity: int = 0


class CacheIndex(Protocol):
    """The storage a `ResponseCache` searches; `now` is the caller's clock (tests move it)."""

    async def get_exact(self, scope_hash: str, exact_key: str, now: float) -> CacheEntry | None: ...

    async def nearest(
        self, scope_hash: str, vector: np.ndarray, k: int, min_similarity: float, now: float
    ) -> list[tuple[CacheEntry, float]]: ...

    async def touch(self, scope_hash: str, entry_id: str, now: float) -> None:
        """Mark an entry used (a semantic hit), for LRU order."""
        ...

    async def put(self, entry: CacheEntry, now: float) -> Evictions: ...

    async def get(self, scope_hash: str, entry_id: str, now: float) -> CacheEntry | None: ...

    async def remove(self, scope_hash: str, entry_id: str) -> bool: ...

    async def size(self) -> tuple[int, int]:
        """(entries, bytes) held."""
        ...

    async def close(self) -> None: ...


@dataclass(slots=True)
class _ScopeVectors:
    """The unit vectors of one scope's entries, one row each, grown by doubling, removed by swap."""

    ids: list[str] = field(default_factory=list)
    matrix: np.ndarray | None = None
    row: dict[str, int] = field(default_factory=dict)
    exact: dict[str, str] = field(default_factory=dict)  # exact key -> entry id

    def add(self, entry_id: str, vector: np.ndarray) -> None:
        n = len(self.ids)
        if self.matrix is None:
            self.matrix = np.empty((8, vector.shape[0]), dtype=np.float32)
        elif n == self.matrix.shape[0]:
            grown = np.empty((2 * n, self.matrix.shape[1]), dtype=np.float32)
            grown[:n] = self.matrix
            self.matrix = grown
        self.matrix[n] = vector
        self.ids.append(entry_id)
        self.row[entry_id] = n

    def discard(self, entry_id: str) -> None:
        r = self.row.pop(entry_id, None)
        if r is None or self.matrix is None:
            return
        last = len(self.ids) - 1
        if r != last:
            moved = self.ids[last]
            self.matrix[r] = self.matrix[last]
            self.ids[r] = moved
            self.row[moved] = r
        self.ids.pop()

    def search(self, vector: np.ndarray, k: int, min_similarity: float) -> list[tuple[str, float]]:
        n = len(self.ids)
        if n == 0 or self.matrix is None:
            return []
        sims = self.matrix[:n] @ vector
        if n > k:
            top = np.argpartition(-sims, k - 1)[:k]
        else:
            top = np.arange(n)
        top = top[np.argsort(-sims[top])]
        return [(self.ids[i], float(sims[i])) for i in top if sims[i] >= min_similarity]

    @property
    def empty(self) -> bool:
        return not self.ids and not self.exact


class MemoryIndex:
    """The in-process index: one gateway process, bounded by entries and bytes, LRU eviction."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, CacheEntry] = OrderedDict()  # least recently used first
        self._scopes: dict[str, _ScopeVectors] = {}
        self._expiry: list[tuple[float, str]] = []  # heap; stale rows (entry gone) are skipped
        self._bytes = 0

    def _live(self, entry_id: str | None, now: float) -> CacheEntry | None:
        entry = self._entries.get(entry_id) if entry_id else None
        if entry is None:
            return None
        if entry.expires_at <= now:
            self._drop(entry_id)  # type: ignore[arg-type]
            return None
        return entry

    def _touch(self, entry: CacheEntry) -> CacheEntry:
        self._entries.move_to_end(entry.id)
        return entry

    async def get_exact(self, scope_hash: str, exact_key: str, now: float) -> CacheEntry | None:
        scope = self._scopes.get(scope_hash)
        entry = self._live(scope.exact.get(exact_key), now) if scope else None
        return self._touch(entry) if entry else None

    async def nearest(
        self, scope_hash: str, vector: np.ndarray, k: int, min_similarity: float, now: float
    ) -> list[tuple[CacheEntry, float]]:
        scope = self._scopes.get(scope_hash)
        if scope is None:
            return []
        out = []
        for entry_id, sim in scope.search(vector, k, min_similarity):
            entry = self._live(entry_id, now)
            if entry is not None:
                out.append((entry, sim))
        return out

    async def get(self, scope_hash: str, entry_id: str, now: float) -> CacheEntry | None:
        entry = self._live(entry_id, now)
        return entry if entry is not None and entry.scope_hash == scope_hash else None

    async def touch(self, scope_hash: str, entry_id: str, now: float) -> None:
        if entry_id in self._entries:
            self._entries.move_to_end(entry_id)

    async def put(self, entry: CacheEntry, now: float) -> Evictions:
        ev = Evictions()
        scope = self._scopes.setdefault(entry.scope_hash, _ScopeVectors())
        old = scope.exact.get(entry.exact_key)
        if old is not None:
            self._drop(old)  # the same question asked again: the newer answer replaces the older
            scope = self._scopes.setdefault(entry.scope_hash, scope)
        self._entries[entry.id] = entry
        self._bytes += entry.size
        scope.exact[entry.exact_key] = entry.id
        if entry.vector is not None:
            scope.add(entry.id, entry.vector)
        heapq.heappush(self._expiry, (entry.expires_at, entry.id))
        if len(self._expiry) > 2 * len(self._entries) + 64:
            # rows of entries already evicted or replaced pile up: rebuild from the live entries
            self._expiry = [(e.expires_at, e.id) for e in self._entries.values()]
            heapq.heapify(self._expiry)
        ev.expired = self._sweep(now)
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            victim = next(iter(self._entries))
            self._drop(victim)
            ev.capacity += 1
        return ev

    async def remove(self, scope_hash: str, entry_id: str) -> bool:
        entry = self._entries.get(entry_id)
        if entry is None or entry.scope_hash != scope_hash:
            return False
        self._drop(entry_id)
        return True

    async def size(self) -> tuple[int, int]:
        return len(self._entries), self._bytes

    async def close(self) -> None:
        self._entries.clear()
        self._scopes.clear()
        self._expiry.clear()
        self._bytes = 0

    def _sweep(self, now: float) -> int:
        n = 0
        while self._expiry and self._expiry[0][0] <= now:
            _, entry_id = heapq.heappop(self._expiry)
            entry = self._entries.get(entry_id)
            if entry is not None and entry.expires_at <= now:
                self._drop(entry_id)
                n += 1
        return n

    def _drop(self, entry_id: str) -> None:
        entry = self._entries.pop(entry_id, None)
        if entry is None:
            return
        self._bytes -= entry.size
        scope = self._scopes.get(entry.scope_hash)
        if scope is None:
            return
        scope.discard(entry_id)
        if scope.exact.get(entry.exact_key) == entry_id:
            del scope.exact[entry.exact_key]
        if scope.empty:
            del self._scopes[entry.scope_hash]
