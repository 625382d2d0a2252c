# C types of sessions.py for the compiled build (Cython pure-Python mode; see cache_service/native.py).
cimport cython

from cache_service.core.slot cimport SessionSlot, Slots


@cython.final
cdef class SessionTable:
    cdef public Slots _slots
    cdef public object _by_id, _parked
    cdef public dict _opened, _per_identity
    cdef public Py_ssize_t _next_epoch
    cdef public list _spare

    @cython.locals(left=Py_ssize_t)
    cpdef remove(self, SessionSlot s)

    @cython.locals(s=SessionSlot)
    cpdef SessionSlot create(self, object session_id, bint streaming, object cache_salt, object owner,
                             object identity, object timeout_seconds, object now)
