"""Exact and semantic response caches, always inside a hard scope (tenant, model, conversation, params).

Public API: `ResponseCache` (lookup / store / report_false_hit), `CacheScope`, `CacheDirective` and
`directive_from_headers`, `CachedResponse`, `assemble_stream`, `CacheConfig`. See docs/cache.md.
"""

from tokenops.cache.cache import ResponseCache
from tokenops.cache.config import CacheConfig
from tokenops.cache.response import MISS_HEADERS, CachedResponse, assemble_stream
from tokenops.cache.scope import BodyRequest, CacheDirective, CacheScope, directive_from_headers

__all__ = [
    "MISS_HEADERS",
    "BodyRequest",
    "CacheConfig",
    "CacheDirective",
    "CacheScope",
    "CachedResponse",
    "ResponseCache",
    "assemble_stream",
    "directive_from_headers",
]
