# C types of slot.py for the compiled build (Cython pure-Python mode; see cache_service/native.py).
cimport cython

from cache_service.core.ledger cimport Counters
from cache_service.core.radix cimport RadixTree
from cache_service.core.radix_node cimport RadixNode


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
    cdef public object changes
    cdef public Py_ssize_t _ps, num_in_turn, num_closing, num_demoted, num_parked
    cdef public RadixTree _radix
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

    cpdef park(self, SessionSlot s, double until)

    cpdef adopt(self, SessionSlot s, object engine_id)
