"""PagePool: the KV cache's pages on the host: free list, ref counts, prefix cache, LRU eviction.

Host-only (no JAX). Page 0 is the null page: never handed out (padding writes land there).

Every page is in exactly one state:
  free       ref 0, no hash, in `_free_page_ids` (handed out first, FIFO)
  cached     ref 0, hashed, in `_evictable` (kept for prefix hits; evicted LRU when no page is free)
  in use     ref > 0 (hashed or not); a hashed page may be shared by several requests

A FULL page is keyed by `hash_page(parent page's hash, its token ids, extra key)`: a page's hash
names its whole prefix, so equal hashes mean equal K/V (sha256: no collisions to forge).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Sequence

import numpy as np

NULL_PAGE = 0


def hash_page(parent_hash: bytes | None, token_ids: Sequence[int], extra_key: str | None = None) -> bytes:
    h = hashlib.sha256()
    h.update(parent_hash if parent_hash is not None else b"root")
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    if extra_key is not None:
        h.update(b"\x00extra:" + extra_key.encode())
    return h.digest()


def extend_page_hashes(page_hashes: list[bytes], token_ids: Sequence[int], page_size: int,
                       extra_key: str | None = None) -> list[bytes]:
    """Appends the hash of every full page of `token_ids` not yet in `page_hashes` (in place)."""
    for i in range(len(page_hashes), len(token_ids) // page_size):
        parent = page_hashes[i - 1] if i else None
        page_hashes.append(hash_page(parent, token_ids[i * page_size:(i + 1) * page_size], extra_key))
    return page_hashes


@dataclasses.dataclass
class PrefixCacheCounters:
    num_query_tokens: int = 0  # prompt tokens looked up at admission
    num_hit_tokens: int = 0  # of which served from the cache

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0


class PagePool:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        if num_pages < 2:
            raise ValueError(f"{num_pages=} must be at least 2 (page 0 is the null page)")
        if page_size <= 0:
            raise ValueError(f"{page_size=} must be positive")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_pages
        self._free_page_ids: collections.deque[int] = collections.deque(range(1, num_pages))
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self._page_hash: dict[int, bytes] = {}  # page id -> hash (cached or in use)
        self._cached: dict[bytes, int] = {}  # hash -> page id
        self.counters = PrefixCacheCounters()
        self.num_evictions = 0

    # -- sizes ------------------------------------------------------------------------------
    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        """Pages `allocate` can hand out now: free ones plus cached ones with no user."""
        return len(self._free_page_ids) + len(self._evictable)

    @property
    def num_used_pages(self) -> int:
        return self.num_usable_pages - self.num_free_pages

    @property
    def num_cached_pages(self) -> int:
        return len(self._cached)

    def ref_count(self, page_id: int) -> int:
        return self._ref_counts[page_id]

    def is_cached(self, page_id: int) -> bool:
        return page_id in self._page_hash

    # -- allocate / free --------------------------------------------------------------------
    def allocate(self, num_pages: int) -> list[int] | None:
        """`num_pages` fresh pages (ref 1), or None (and no change) when there are not enough."""
        if num_pages < 0:
            raise ValueError(f"{num_pages=} must be >= 0")
        if num_pages > self.num_free_pages:
            return None
        page_ids = []
        for _ in range(num_pages):
            if self._free_page_ids:
                page_id = self._free_page_ids.popleft()
            else:
                page_id, _ = self._evictable.popitem(last=False)
                del self._cached[self._page_hash.pop(page_id)]
                self.num_evictions += 1
            self._ref_counts[page_id] = 1
            page_ids.append(page_id)
        return page_ids

    def free(self, page_ids: Sequence[int]) -> None:
        """Drops one reference to each page. Walked tail first, so a freed request's last pages are
        evicted before its first ones (a prefix's head is useful without its tail, not vice versa)."""
        for page_id in reversed(page_ids):
            if not 0 < page_id < self.num_pages or self._ref_counts[page_id] <= 0:
                raise ValueError(f"{page_id=} is not an allocated page")
            self._ref_counts[page_id] -= 1
            if self._ref_counts[page_id] == 0:
                if page_id in self._page_hash:
                    self._evictable[page_id] = None
                else:
                    self._free_page_ids.append(page_id)

    # -- prefix cache -----------------------------------------------------------------------
    def find_cached_prefix(self, page_hashes: Sequence[bytes], max_num_pages: int) -> list[int]:
        """Page ids of the longest cached run of `page_hashes[:max_num_pages]`. Changes nothing."""
        page_ids = []
        if not self.enable_prefix_caching:
            return page_ids
        for h in page_hashes[:max_num_pages]:
            page_id = self._cached.get(h)
            if page_id is None:
                break
            page_ids.append(page_id)
        return page_ids

    def num_evictable_among(self, page_ids: Sequence[int]) -> int:
        """How many of `page_ids` are cached with no user (taking them shrinks `num_free_pages`)."""
        return sum(1 for p in page_ids if self._ref_counts[p] == 0)

    def acquire(self, page_ids: Sequence[int]) -> None:
        """One more reference to each (cached, prefix-hit) page."""
        for page_id in page_ids:
            if page_id not in self._page_hash:
                raise ValueError(f"{page_id=} is not a cached page")
            if self._ref_counts[page_id] == 0:
                del self._evictable[page_id]
            self._ref_counts[page_id] += 1

    def cache_page(self, page_id: int, page_hash: bytes) -> bool:
        """Registers a full, written, in-use page. False when caching is off or that content is
        already cached under another page (the duplicate stays private and is freed normally)."""
        if not self.enable_prefix_caching or page_hash in self._cached:
            return False
        if self._ref_counts[page_id] <= 0 or page_id in self._page_hash:
            raise ValueError(f"{page_id=} must be in use and not yet cached")
        self._cached[page_hash] = page_id
        self._page_hash[page_id] = page_hash
        return True

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.counters.num_query_tokens += num_query_tokens
        self.counters.num_hit_tokens += num_hit_tokens

    def reset_prefix_cache(self) -> None:
        """Forgets every cached page with no user (in-use pages keep their hashes)."""
        for page_id in self._evictable:
            del self._cached[self._page_hash.pop(page_id)]
            self._free_page_ids.append(page_id)
        self._evictable.clear()

    # -- checks -----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        free, evictable = list(self._free_page_ids), list(self._evictable)
        assert NULL_PAGE not in free and NULL_PAGE not in self._evictable, "null page handed out"
        assert self._ref_counts[NULL_PAGE] == 0 and NULL_PAGE not in self._page_hash
        assert len(set(free)) == len(free), "a page is twice in the free list"
        assert not set(free) & set(evictable), "a page is both free and cached"
        for page_id in range(1, self.num_pages):
            ref = self._ref_counts[page_id]
            assert ref >= 0, f"{page_id=} has ref count {ref}"
            if ref > 0:
                assert page_id not in self._evictable and page_id not in free, f"{page_id=} in use and free"
        for page_id in free:
            assert self._ref_counts[page_id] == 0 and page_id not in self._page_hash
        for page_id in evictable:
            assert self._ref_counts[page_id] == 0 and page_id in self._page_hash
        num_in_use = sum(1 for r in self._ref_counts if r > 0)
        assert num_in_use + len(free) + len(evictable) == self.num_usable_pages, "a page is lost"
        assert len(self._cached) == len(self._page_hash)
        for h, page_id in self._cached.items():
            assert self._page_hash[page_id] == h
