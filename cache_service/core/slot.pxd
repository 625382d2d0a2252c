# C types of slot.py for the compiled build (Cython pure-Python mode; see cache_service/native.py).
cimport cython

from cache_service.core.ledger cimport Counters, PageLedger
from cache_service.core.pages cimport PageAllocator
from cache_service.core.radix cimport RadixNode, RadixTree


@cython.final
cdef class SessionSlot:
    cdef public object cache_salt, epoch, former_owner, id, identity, owner, state, parent_id
    cdef public bint demoted, parked, radix_turn, streaming
    cdef public Py_ssize_t committed_pages, committed_tokens, kv_tokens, radix_pages, synced_pages, turns, close_mode
    cdef public Py_ssize_t turn_cached_tokens, turn_context_tokens
    cdef public double last_active, parked_until, timeout_seconds
    cdef public RadixNode lock_node, guard_node
    cdef public SessionSlot parent
    cdef public list children
    cdef public bytearray pages, tokens

    cpdef reset(self, object session_id, object epoch, bint streaming, object cache_salt, object owner,
                object identity, double timeout_seconds, double now)


@cython.final
cdef class Slots:
    cdef public object _config, _victims, changes
    cdef public Py_ssize_t _ps, num_in_turn, num_closing, num_demoted, num_parked
    cdef public PageAllocator _pages
    cdef public RadixTree _radix
    cdef public PageLedger _ledger
    cdef public Counters _c

    cpdef transition(self, SessionSlot s, object state)
    cpdef set_demoted(self, SessionSlot s, bint demoted)
    cpdef release(self, SessionSlot s)

    @cython.locals(node=RadixNode, end=Py_ssize_t)
    cpdef link(self, SessionSlot child, SessionSlot parent)

    @cython.locals(p=SessionSlot)
    cpdef unlink(self, SessionSlot child)

    @cython.locals(c=SessionSlot)
    cpdef orphan(self, SessionSlot parent)

    @cython.locals(old=RadixNode)
    cpdef set_guard(self, SessionSlot s, RadixNode node)

    @cython.locals(ps=Py_ssize_t, full=Py_ssize_t)
    cpdef park(self, SessionSlot s, double until, bint fence)

    cpdef adopt(self, SessionSlot s, object engine_id)

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

    @cython.locals(ps=Py_ssize_t, n=Py_ssize_t)
    cpdef Py_ssize_t cached_tokens(self, SessionSlot s) except -1

    @cython.locals(counts=list, v=SessionSlot, upto=Py_ssize_t, demoting=bint, pages=PageAllocator)
    cpdef object allocate(self, object n, SessionSlot s)

    @cython.locals(ps=Py_ssize_t, pinned=Py_ssize_t, pages=bytearray, existing=Py_ssize_t, end=Py_ssize_t,
                   old=RadixNode)
    cpdef RadixNode _cache_into_radix(self, SessionSlot s, Py_ssize_t num_pages, bint pin, Py_ssize_t src)


cpdef bytes _span(bytearray buf, Py_ssize_t start, Py_ssize_t end)
