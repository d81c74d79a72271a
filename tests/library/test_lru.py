"""``dxcontract.lru.LRU``: the count bound and the byte bound (``max_bytes`` with
``sizeof``): eviction order, an entry over the whole budget, and the bytes accounted
on replace, pop, discard, clear and remeasure."""

from __future__ import annotations

import threading

import pytest

from dxcontract.lru import LRU


def _sized(max_bytes: int, maxsize: int = 100) -> tuple[LRU, list]:
    evicted: list = []
    lru = LRU(maxsize, max_bytes, len, lambda k, v, size: evicted.append((k, size)))
    return lru, evicted


def test_count_bound_evicts_least_recently_used() -> None:
    lru: LRU[str, int] = LRU(2)
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.get("a") == 1  # a is now the most recent
    lru.put("c", 3)
    assert lru.keys() == ["a", "c"] and lru.nbytes == 0
    assert (lru.hits, lru.misses) == (1, 0)


def test_byte_bound_evicts_least_recently_used_until_it_fits() -> None:
    lru, evicted = _sized(10)
    assert lru.put("a", "xxxx") and lru.put("b", "yyy") and lru.put("c", "zz")
    assert lru.nbytes == 9
    lru.get("a")  # a refreshed: b and c are older
    assert lru.put("d", "wwwww")  # 14 bytes: b (3) then c (2) go, 9 left
    assert lru.keys() == ["a", "d"] and lru.nbytes == 9
    assert evicted == [("b", 3), ("c", 2)]
    assert lru.size_of("a") == 4 and lru.size_of("b") is None


def test_peek_does_not_refresh_for_eviction() -> None:
    lru, _ = _sized(6)
    lru.put("a", "aaa")
    lru.put("b", "bbb")
    lru.peek("a")
    lru.put("c", "c")
    assert lru.keys() == ["b", "c"]


def test_entry_over_the_budget_is_not_kept_and_evicts_nothing() -> None:
    lru, evicted = _sized(10)
    lru.put("a", "aaaa")
    assert lru.put("big", "x" * 11) is False
    assert lru.keys() == ["a"] and lru.nbytes == 4 and evicted == []
    assert lru.put("edge", "x" * 6)  # exactly the budget with a: fits
    assert lru.nbytes == 10
    assert lru.put("whole", "y" * 10)  # the whole budget alone: kept, the rest evicted
    assert lru.keys() == ["whole"] and lru.nbytes == 10


def test_oversized_replacement_drops_the_old_value() -> None:
    lru, _ = _sized(10)
    lru.put("a", "aaaa")
    assert lru.put("a", "z" * 50) is False
    assert "a" not in lru and lru.nbytes == 0  # never the stale value for that key


def test_replace_accounts_the_new_size_once() -> None:
    lru, evicted = _sized(10)
    lru.put("a", "aaaa")
    lru.put("b", "bb")
    lru.put("a", "a")  # shrinks, and becomes the most recent
    assert lru.nbytes == 3 and lru.keys() == ["b", "a"]
    lru.put("a", "aaaaaaaa")  # grows to 8: 10 in all, nothing evicted
    assert lru.nbytes == 10 and evicted == []
    lru.put("b", "bbb")  # 11: a (the oldest now) goes
    assert lru.keys() == ["b"] and lru.nbytes == 3 and evicted == [("a", 8)]


def test_pop_discard_and_clear_give_bytes_back() -> None:
    lru, evicted = _sized(100)
    for key, value in (("a", "a" * 10), ("b", "b" * 20), ("c", "c" * 30), ("d", "d" * 5)):
        lru.put(key, value)
    assert lru.nbytes == 65
    assert lru.pop("b") == "b" * 20 and lru.nbytes == 45
    assert lru.pop("b") is None and lru.nbytes == 45
    assert lru.discard_where(lambda k, v: len(v) >= 10) == 2
    assert lru.keys() == ["d"] and lru.nbytes == 5
    lru.clear()
    assert len(lru) == 0 and lru.nbytes == 0
    assert evicted == []  # only evictions to make room are told


def test_remeasure_after_values_grow_evicts_to_the_budget() -> None:
    lru, evicted = _sized(10)
    grows, other = bytearray(b"ab"), bytearray(b"cdef")
    lru.put("grows", grows)
    lru.put("other", other)
    assert lru.nbytes == 2 + 4
    grows.extend(b"xyz")  # 5 now, not yet measured
    assert lru.nbytes == 6
    assert lru.remeasure(lambda k, v: v is grows) == 9
    grows.extend(b"zz")  # 7 + 4 = 11: the oldest (grows itself) is evicted
    lru.remeasure()
    assert lru.keys() == ["other"] and lru.nbytes == 4 and evicted == [("grows", 7)]


def test_count_and_byte_bounds_together() -> None:
    lru, evicted = _sized(1000, maxsize=2)
    lru.put("a", "a")
    lru.put("b", "b")
    lru.put("c", "c")
    assert lru.keys() == ["b", "c"] and lru.nbytes == 2 and evicted == [("a", 1)]


def test_max_bytes_needs_sizeof() -> None:
    with pytest.raises(ValueError, match="sizeof"):
        LRU(4, max_bytes=10)


def test_bytes_stay_consistent_under_threads() -> None:
    lru: LRU[int, str] = LRU(64, 500, len)

    def work(offset: int) -> None:
        for i in range(2000):
            key = (offset * 7 + i) % 97
            if i % 5 == 0:
                lru.pop(key)
            else:
                lru.put(key, "x" * (i % 40))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert lru.nbytes == sum(lru.size_of(k) for k in lru.keys()) <= 500
    assert len(lru) <= 64
