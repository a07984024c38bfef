import pytest

from jaxinfer.sched.page_pool import NULL_PAGE, PagePool, extend_page_hashes, hash_page


def hashes_of(tokens, page_size=4, extra=None):
    return extend_page_hashes([], tokens, page_size, extra)


def test_allocate_hands_out_exact_ids_and_never_the_null_page():
    pool = PagePool(num_pages=6, page_size=4)
    assert pool.allocate(2) == [1, 2]
    assert pool.allocate(3) == [3, 4, 5]
    assert pool.num_free_pages == 0
    assert pool.allocate(1) is None  # full: None, nothing changed
    pool.check_invariants()
    pool.free([1, 2])  # tail first: 2 then 1 go to the back of the free list
    assert pool.allocate(1) == [2]
    assert pool.allocate(1) == [1]
    assert NULL_PAGE not in range(1, 6) and pool.ref_count(NULL_PAGE) == 0
    pool.check_invariants()


def test_allocate_too_many_changes_nothing():
    pool = PagePool(num_pages=4, page_size=4)
    assert pool.allocate(4) is None
    assert pool.num_free_pages == 3
    assert pool.allocate(0) == []
    assert pool.allocate(3) == [1, 2, 3]


def test_free_of_unallocated_page_raises():
    pool = PagePool(num_pages=4, page_size=4)
    with pytest.raises(ValueError, match="page_id=1"):
        pool.free([1])
    with pytest.raises(ValueError, match="page_id=0"):
        pool.free([0])


def test_ref_counts_with_shared_cached_pages():
    pool = PagePool(num_pages=8, page_size=4)
    h = hashes_of([5, 6, 7, 8, 9, 10, 11, 12])
    a = pool.allocate(2)
    assert a == [1, 2]
    assert pool.cache_page(1, h[0]) and pool.cache_page(2, h[1])
    hit = pool.find_cached_prefix(h, max_num_pages=2)
    assert hit == [1, 2]
    pool.acquire(hit)
    assert [pool.ref_count(p) for p in (1, 2)] == [2, 2]
    pool.free(a)
    assert [pool.ref_count(p) for p in (1, 2)] == [1, 1]
    assert pool.num_used_pages == 2
    pool.free(hit)
    assert pool.num_used_pages == 0 and pool.num_cached_pages == 2
    assert pool.num_free_pages == 7  # cached pages with no user count as free
    pool.check_invariants()


def test_prefix_lookup_stops_at_first_miss_and_at_the_limit():
    pool = PagePool(num_pages=8, page_size=4)
    tokens = list(range(2, 14))  # 3 full pages
    h = hashes_of(tokens)
    pages = pool.allocate(3)
    pool.cache_page(pages[0], h[0])
    pool.cache_page(pages[2], h[2])  # page 2 of the chain cached, page 1 not
    assert pool.find_cached_prefix(h, 3) == [pages[0]]
    pool.cache_page(pages[1], h[1])
    assert pool.find_cached_prefix(h, 3) == pages
    assert pool.find_cached_prefix(h, 2) == pages[:2]
    other = hashes_of([2, 3, 4, 5, 99, 7, 8, 9])
    assert pool.find_cached_prefix(other, 2) == [pages[0]]


def test_hash_depends_on_parent_tokens_and_extra_key():
    a = hash_page(None, [1, 2, 3, 4])
    assert a == hash_page(None, [1, 2, 3, 4])
    assert a != hash_page(None, [1, 2, 3, 5])
    assert a != hash_page(None, [1, 2, 3, 4], "tenant-b")
    assert hash_page(a, [1, 2, 3, 4]) != hash_page(None, [1, 2, 3, 4])
    # same second page after different first pages: different hashes
    h1 = hashes_of([1, 1, 1, 1, 9, 9, 9, 9])
    h2 = hashes_of([2, 2, 2, 2, 9, 9, 9, 9])
    assert h1[1] != h2[1]
    assert len(hashes_of([1] * 7)) == 1  # only full pages are hashed


def test_duplicate_content_is_not_cached_twice():
    pool = PagePool(num_pages=8, page_size=4)
    h = hashes_of([3, 3, 3, 3])
    a, b = pool.allocate(1), pool.allocate(1)
    assert pool.cache_page(a[0], h[0])
    assert not pool.cache_page(b[0], h[0])
    pool.free(b)
    assert not pool.is_cached(b[0])
    pool.check_invariants()


def test_cached_pages_are_kept_and_evicted_lru_only_when_no_page_is_free():
    pool = PagePool(num_pages=6, page_size=4)  # usable pages 1..5
    h = hashes_of(list(range(2, 14)))
    req = pool.allocate(3)  # [1, 2, 3]
    for p, hh in zip(req, h):
        pool.cache_page(p, hh)
    pool.free(req)  # evictable LRU order: 3, 2, 1 (tail first)
    assert pool.num_cached_pages == 3 and pool.num_free_pages == 5
    assert pool.allocate(2) == [4, 5]  # the free list first: nothing evicted
    assert pool.num_cached_pages == 3 and pool.num_evictions == 0
    assert pool.allocate(1) == [3]  # then the least recently used cached page: the tail
    assert pool.find_cached_prefix(h, 3) == [1, 2]
    # a hit refreshes: acquire 1 and free it again -> 1 is now the most recently used
    pool.acquire([1])
    pool.free([1])
    assert pool.allocate(1) == [2]
    assert pool.allocate(1) == [1]
    assert pool.num_cached_pages == 0 and pool.num_evictions == 3
    assert pool.find_cached_prefix(h, 3) == []
    pool.check_invariants()


def test_prefix_caching_disabled():
    pool = PagePool(num_pages=4, page_size=4, enable_prefix_caching=False)
    h = hashes_of([1, 2, 3, 4])
    p = pool.allocate(1)
    assert not pool.cache_page(p[0], h[0])
    assert pool.find_cached_prefix(h, 1) == []
    pool.free(p)
    assert pool.allocate(3) == [2, 3, 1]


def test_reset_prefix_cache_frees_unused_cached_pages():
    pool = PagePool(num_pages=4, page_size=4)
    h = hashes_of(list(range(8)))
    a = pool.allocate(2)
    pool.cache_page(a[0], h[0])
    pool.cache_page(a[1], h[1])
    pool.free(a[1:])
    pool.reset_prefix_cache()
    assert pool.num_cached_pages == 1 and pool.is_cached(a[0]) and not pool.is_cached(a[1])
    pool.check_invariants()


def test_hit_rate_counters():
    pool = PagePool(num_pages=4, page_size=4)
    assert pool.counters.hit_rate == 0.0
    pool.record_prefix_query(10, 0)
    pool.record_prefix_query(10, 8)
    assert pool.counters.hit_rate == pytest.approx(0.4)


def test_check_invariants_catches_a_lost_page():
    pool = PagePool(num_pages=4, page_size=4)
    pool.allocate(1)
    pool._ref_counts[1] = 0  # lost: neither free nor in use
    with pytest.raises(AssertionError):
        pool.check_invariants()
