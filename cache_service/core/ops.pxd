# C types of ops.py for the compiled build (Cython pure-Python mode; see cache_service/native.py).
cimport cython

from cache_service.core.leases cimport Lease, LeaseTable
from cache_service.core.lifecycle cimport Lifecycle
from cache_service.core.pages cimport PageAllocator
from cache_service.core.radix cimport RadixTree
from cache_service.core.sessions cimport SessionTable
from cache_service.core.slot cimport SessionSlot, Slots
from cache_service.core.turns cimport Turns


@cython.final
cdef class Ops:
    cdef public object config, _clock, _by_id, _cap, reuse
    cdef public LeaseTable _leases
    cdef public PageAllocator _pages
    cdef public RadixTree _radix
    cdef public Slots _slots
    cdef public Turns _turns
    cdef public SessionTable _sessions
    cdef public Lifecycle _life

    @cython.locals(s=SessionSlot, lease=Lease)
    cpdef tuple open(self, object session_id, bint streaming, object timeout_seconds, object cache_salt,
                     object engine_id, object identity, object quota, object parent_session_id=*)

    @cython.locals(p=SessionSlot, up=SessionSlot)
    cpdef SessionSlot _parent(self, object parent_id, object session_id, object cache_salt, object identity)

    @cython.locals(s=SessionSlot, context=Py_ssize_t, adopter=Lease)
    cpdef tuple append(self, object session_id, object tokens, object reserve_tokens, object epoch, object engine_id,
                       object identity)

    @cython.locals(s=SessionSlot, capacity=Py_ssize_t)
    cpdef tuple extend(self, object session_id, object reserve_tokens, object epoch, object engine_id,
                       object identity)

    @cython.locals(s=SessionSlot, closed=bint)
    cpdef tuple commit(self, object session_id, object generated, object kv_tokens, bint abort, object turn,
                       object epoch, object engine_id, object identity, object reuse=*)

    @cython.locals(s=SessionSlot)
    cpdef tuple close(self, object session_id, bint cache, object epoch, object engine_id, object identity,
                      object mode=*)

    @cython.locals(s=SessionSlot, lease=Lease)
    cpdef SessionSlot session(self, object session_id, object epoch, object engine_id, object identity, object now,
                              bint appending)

    cpdef check_turn(self, SessionSlot s, object turn)

    @cython.locals(new_total=Py_ssize_t, capacity=Py_ssize_t, generated=Py_ssize_t)
    cpdef Py_ssize_t _kv_after_commit(self, SessionSlot s, Py_ssize_t generated, object kv_tokens) except -1
