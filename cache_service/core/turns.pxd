# C types of turns.py for the compiled build (Cython pure-Python mode; see cache_service/native.py).
cimport cython

from cache_service.core.ledger cimport Counters, PageLedger
from cache_service.core.pages cimport PageAllocator
from cache_service.core.radix cimport RadixTree
from cache_service.core.radix_node cimport RadixNode
from cache_service.core.slot cimport SessionSlot, Slots


@cython.final
cdef class Turns:
    cdef public object _config, _victims
    cdef public Py_ssize_t _ps
    cdef public PageAllocator _pages
    cdef public RadixTree _radix
    cdef public PageLedger _ledger
    cdef public Counters _c
    cdef public Slots _slots

    @cython.locals(ps=Py_ssize_t, context=Py_ssize_t, base_pages=Py_ssize_t, radix_turn=bint, lock_node=RadixNode,
                   n=Py_ssize_t, cached=Py_ssize_t, radix_hit=Py_ssize_t, c=Counters, offset=Py_ssize_t,
                   num_pages=Py_ssize_t)
    cpdef tuple begin(self, SessionSlot s, object tokens, object reserve_tokens)

    @cython.locals(ps=Py_ssize_t, held=Py_ssize_t, offset=Py_ssize_t)
    cpdef tuple extend(self, SessionSlot s, object reserve_tokens)

    @cython.locals(ps=Py_ssize_t, total=Py_ssize_t, c=Counters, prompt_pages=Py_ssize_t, keep=Py_ssize_t,
                   node=RadixNode)
    cpdef commit(self, SessionSlot s, object generated, Py_ssize_t kv)

    cpdef abort(self, SessionSlot s)

    @cython.locals(start=Py_ssize_t, committed=Py_ssize_t, full=Py_ssize_t, src=Py_ssize_t, pages=bytearray,
                   rest=Py_ssize_t, node=RadixNode)
    cpdef RadixNode drop_kv(self, SessionSlot s, bint cache)

    @cython.locals(ps=Py_ssize_t, full=Py_ssize_t)
    cpdef fence(self, SessionSlot s)

    @cython.locals(ps=Py_ssize_t, n=Py_ssize_t)
    cpdef Py_ssize_t cached_tokens(self, SessionSlot s) except -1

    @cython.locals(counts=list, v=SessionSlot, upto=Py_ssize_t, demoting=bint, pages=PageAllocator)
    cpdef object allocate(self, object n, SessionSlot s)

    @cython.locals(ps=Py_ssize_t, pinned=Py_ssize_t, pages=bytearray, existing=Py_ssize_t, end=Py_ssize_t,
                   old=RadixNode)
    cpdef RadixNode _cache_into_radix(self, SessionSlot s, Py_ssize_t num_pages, bint pin, Py_ssize_t src)


cpdef bytes _span(bytearray buf, Py_ssize_t start, Py_ssize_t end)
