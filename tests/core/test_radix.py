from __future__ import annotations

import numpy as np
import pytest

from cache_service.core import InvariantError
from cache_service.core.ledger import FREE, PageLedger
from cache_service.core.radix import RadixTree, token_key


def ids(pages: bytes) -> list[int]:
    return np.frombuffer(pages, dtype=np.int32).tolist()


def pages_of(values: list[int] | np.ndarray) -> bytes:
    return np.asarray(values, dtype=np.int32).tobytes()


class Tree:
    """A RadixTree on tokens (not bytes) that records every page it frees (its ledger starts with the
    pages it is given counted as evictable, since nothing allocates them)."""

    def __init__(self, page_size: int = 1, policy: str = "lru") -> None:
        self.freed: list[list[int]] = []
        self.ledger = PageLedger(1 << 20)
        self.tree = RadixTree(page_size, self.ledger, self._free, policy)
        self.ps = page_size

    def _free(self, pages: bytes, src: int) -> None:
        self.freed.append(ids(pages))
        self.ledger.move(len(pages) >> 2, src, FREE)

    def key(self, tokens: list[int]) -> bytes:
        return token_key(np.array(tokens, dtype=np.int32), self.ps)

    def insert(self, tokens: list[int], pages: list[int], salt: str = "") -> int:
        res = self.tree.insert(salt, self.key(tokens), pages_of(pages), src=FREE)
        return res.num_existing_pages

    def match(self, tokens: list[int], salt: str = "") -> list[int]:
        return ids(self.tree.match(salt, self.key(tokens)).pages)

    def counts(self) -> tuple[int, int]:
        self.tree.check()
        return self.tree.evictable_pages, self.tree.locked_pages


def test_insert_then_match_returns_the_pages_of_the_longest_prefix() -> None:
    t = Tree()
    assert t.insert([1, 2, 3], [10, 20, 30]) == 0
    assert t.match([1, 2]) == [10, 20]
    assert t.match([1, 2, 3, 4]) == [10, 20, 30]
    assert t.match([2, 3]) == []
    assert t.counts() == (3, 0)


def test_insert_reports_existing_pages_and_keeps_the_trees_copies() -> None:
    t = Tree()
    t.insert([1, 2, 3], [10, 20, 30])
    res = t.tree.insert("", t.key([1, 2, 3, 4, 5]), pages_of([91, 92, 93, 94, 95]), src=FREE)
    assert res.num_existing_pages == 3
    assert ids(res.pages) == [10, 20, 30, 94, 95]
    assert t.match([1, 2, 3, 4, 5]) == [10, 20, 30, 94, 95]
    assert t.counts() == (5, 0)


def test_divergence_splits_a_node_and_both_branches_match() -> None:
    t = Tree()
    t.insert([1, 2, 3, 4, 5, 6, 7, 8], [11, 12, 13, 14, 15, 16, 17, 18])
    assert t.insert([1, 2, 9, 10], [21, 22, 23, 24]) == 2
    assert t.match([1, 2, 3, 4, 999, 1000]) == [11, 12, 13, 14]
    assert t.match([1, 2, 3, 4, 5, 6, 7, 8]) == [11, 12, 13, 14, 15, 16, 17, 18]
    assert t.match([1, 2, 3, 4, 5, 6, 777, 888]) == [11, 12, 13, 14, 15, 16]
    assert t.match([1, 2, 9, 10]) == [11, 12, 23, 24]
    assert t.counts() == (10, 0)
    assert len(t.tree.iter_nodes()) == 4  # root, [1,2], [3..8], [9,10]


def test_salts_never_share_prefixes() -> None:
    t = Tree()
    t.insert([1, 2, 3], [10, 20, 30], salt="tenant-a")
    t.insert([1, 2, 3], [40, 50, 60], salt="tenant-b")
    assert t.match([1, 2, 3], salt="tenant-a") == [10, 20, 30]
    assert t.match([1, 2, 3], salt="tenant-b") == [40, 50, 60]
    assert t.match([1, 2, 3]) == []
    assert t.match([1, 2, 3], salt="tenant-c") == []
    assert t.tree.num_salts == 2


@pytest.mark.parametrize(
    ("page_size", "inserted", "query", "expected"),
    [
        (2, 5, 5, [100, 101]),  # 5 tokens cache 2 whole pages
        (4, 6, 6, [100]),
        (4, 12, 7, [100]),  # a query cut to whole pages
        (4, 12, 3, []),
        (16, 40, 40, [100, 101]),
    ],
)
def test_only_whole_pages_are_cached_and_matched(
    page_size: int, inserted: int, query: int, expected: list[int]
) -> None:
    t = Tree(page_size)
    key = t.key(list(range(inserted)))
    pages = np.arange(100, 100 + len(key) // (4 * page_size), dtype=np.int32)
    t.tree.insert("", key, pages.tobytes(), src=FREE)
    assert t.match(list(range(query))) == expected


def test_page_granular_split_inside_a_multi_token_page_run() -> None:
    t = Tree(page_size=2)
    t.insert([1, 2, 3, 4, 5, 6], [7, 8, 9])
    assert t.insert([1, 2, 3, 9, 9, 9], [17, 18, 19]) == 1  # second page differs in its 2nd token
    assert t.match([1, 2, 3, 9, 9, 9]) == [7, 18, 19]
    assert t.match([1, 2, 3, 4]) == [7, 8]


def test_insert_needs_whole_pages() -> None:
    t = Tree(page_size=2)
    with pytest.raises(InvariantError, match="whole pages"):
        t.tree.insert("", t.key([1, 2, 3, 4]), pages_of([1]), src=FREE)


def test_lru_evicts_least_recently_used_leaf_first() -> None:
    t = Tree()
    t.insert([1, 1], [11, 12])
    t.insert([2, 2], [21, 22])
    t.insert([3, 3], [31, 32])
    t.match([1, 1])  # 1 becomes most recent; 2 is now the oldest
    assert t.tree.evict(2) == 2
    assert t.freed == [[21, 22]]
    assert t.tree.evict(2) == 2
    assert t.freed == [[21, 22], [31, 32]]
    assert t.match([1, 1]) == [11, 12]
    assert t.counts() == (2, 0)


def test_evict_frees_exactly_the_pages_asked_by_trimming_a_leaf_tail() -> None:
    t = Tree()
    t.insert([1, 2, 3, 4], [11, 12, 13, 14])
    assert t.tree.evict(1) == 1
    assert t.freed == [[14]]
    assert t.match([1, 2, 3, 4]) == [11, 12, 13]
    assert t.counts() == (3, 0)


def test_eviction_moves_up_to_a_parent_once_its_children_are_gone() -> None:
    t = Tree()
    t.insert([1, 2, 3], [11, 12, 13])
    t.insert([1, 2, 9], [11, 12, 19])
    t.match([1, 2, 9])
    assert t.tree.evict(3) == 3
    assert t.freed == [[13], [19], [12]]  # leaf [3] (older), leaf [9], then the parent's tail
    assert t.match([1, 2]) == [11]
    assert t.tree.evict(10) == 1
    assert t.tree.num_salts == 0  # an emptied salt leaves nothing behind
    assert t.counts() == (0, 0)


def test_locked_pages_are_never_evicted() -> None:
    t = Tree()
    t.insert([1, 2], [11, 12])
    t.insert([5, 6], [51, 52])
    m = t.tree.match("", t.key([1, 2]), lock=True)
    assert t.counts() == (2, 2)
    assert t.tree.evict(10) == 2
    assert t.freed == [[51, 52]]
    assert m.node is not None
    t.tree.unlock(m.node)
    assert t.counts() == (2, 0)
    assert t.tree.evict(10) == 2


def test_lock_pins_ancestors_and_a_partial_match_lock_splits_the_node() -> None:
    t = Tree()
    t.insert([1, 2, 3, 4], [11, 12, 13, 14])
    m = t.tree.match("", t.key([1, 2, 7]), lock=True)
    assert (m.num_pages, ids(m.pages)) == (2, [11, 12])
    assert t.counts() == (2, 2)  # [1,2] pinned, [3,4] evictable
    assert t.tree.evict(10) == 2
    assert t.freed == [[13, 14]]
    assert m.node is not None
    t.tree.unlock(m.node)
    assert t.counts() == (2, 0)


def test_split_below_a_lock_keeps_the_lock_handle_valid() -> None:
    t = Tree()
    t.insert([1, 2, 3, 4], [11, 12, 13, 14])
    deep = t.tree.match("", t.key([1, 2, 3, 4]), lock=True).node
    shallow = t.tree.match("", t.key([1, 2]), lock=True).node  # splits the locked node
    assert deep is not None and shallow is not None
    assert t.counts() == (0, 4)
    t.tree.unlock(deep)
    assert t.counts() == (2, 2)
    t.tree.unlock(shallow)
    assert t.counts() == (4, 0)


def test_unbalanced_unlock_raises_and_never_goes_negative() -> None:
    t = Tree()
    t.insert([1, 2], [11, 12])
    node = t.tree.match("", t.key([1, 2]), lock=True).node
    assert node is not None
    t.tree.unlock(node)
    with pytest.raises(InvariantError, match="radix lock balance"):
        t.tree.unlock(node)
    assert node.lock_ref == 0
    assert t.counts() == (2, 0)


def test_read_only_match_does_not_touch_lru_order() -> None:
    t = Tree()
    t.insert([1], [11])
    t.insert([2], [21])
    t.tree.match("", t.key([1]), touch=False)
    t.tree.evict(1)
    assert t.freed == [[11]]


def test_lfu_policy_evicts_the_least_hit_leaf_first() -> None:
    t = Tree(policy="lfu")
    t.insert([1], [11])
    t.insert([2], [21])
    for _ in range(3):
        t.match([1])
    t.match([2])  # most recent, but fewer hits
    t.tree.evict(1)
    assert t.freed == [[21]]


def test_unknown_policy_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown eviction policy 'mru'"):
        RadixTree(1, PageLedger(8), lambda p, src: None, "mru")


def test_heap_stays_bounded_under_repeated_touches() -> None:
    t = Tree()
    for i in range(8):
        t.insert([i, i], [10 * i + 1, 10 * i + 2])
    for _ in range(5000):
        t.match([3, 3])
    assert t.tree.heap_entries <= 2 * 8 + 1024
    t.tree.evict(2)
    assert t.freed == [[1, 2]]
