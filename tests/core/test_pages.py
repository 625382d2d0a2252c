from __future__ import annotations

import numpy as np
import pytest

from cache_service.core import InvariantError, PageAllocator


def ids(a: np.ndarray | None) -> list[int]:
    assert a is not None
    return a.tolist()


def test_fresh_pool_hands_out_ascending_ids_and_never_page_zero() -> None:
    alloc = PageAllocator(8)
    assert ids(alloc.alloc(3)) == [1, 2, 3]
    assert ids(alloc.alloc(4)) == [4, 5, 6, 7]
    assert alloc.num_free == 0
    assert alloc.alloc(1) is None
    alloc.check()


def test_freed_pages_are_reused_last_in_first_out() -> None:
    alloc = PageAllocator(8)
    alloc.alloc(5)
    alloc.free(np.array([2, 3], dtype=np.int32))
    assert alloc.num_free == 4
    assert ids(alloc.alloc(3)) == [3, 2, 6]
    alloc.check()


def test_alloc_is_all_or_nothing() -> None:
    alloc = PageAllocator(5)
    alloc.alloc(2)
    assert alloc.alloc(3) is None
    assert alloc.num_free == 2
    assert ids(alloc.alloc(2)) == [3, 4]


def test_alloc_zero_returns_empty() -> None:
    alloc = PageAllocator(4)
    assert ids(alloc.alloc(0)) == []
    assert alloc.num_free == 3


def test_double_free_raises_before_changing_anything() -> None:
    alloc = PageAllocator(6)
    alloc.alloc(3)
    alloc.free(np.array([2], dtype=np.int32))
    with pytest.raises(InvariantError, match="double free of page 2"):
        alloc.free(np.array([1, 2], dtype=np.int32))
    assert alloc.num_free == 3
    assert (alloc.is_allocated(1), alloc.is_allocated(2), alloc.is_allocated(3)) == (True, False, True)
    alloc.check()


@pytest.mark.parametrize("num_pages", [0, 1])
def test_pool_needs_a_page_beyond_the_null_page(num_pages: int) -> None:
    with pytest.raises(ValueError, match="page 0 is reserved"):
        PageAllocator(num_pages)


def test_negative_alloc_is_a_caller_bug() -> None:
    with pytest.raises(ValueError, match="negative"):
        PageAllocator(4).alloc(-1)


def test_metadata_is_five_bytes_per_page() -> None:
    # an int32 free-stack slot and one "allocated" byte per page (a page never has two owners)
    assert PageAllocator(1 << 16).metadata_bytes() == 5 * (1 << 16) - 4
