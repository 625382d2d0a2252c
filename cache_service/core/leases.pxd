# C types of leases.py for the compiled build (Cython pure-Python mode; see cache_service/native.py).
cimport cython


@cython.final
cdef class Lease:
    cdef public object engine_id, expires_at, identity, serial, ttl_seconds
    cdef public bint held
    cdef public set sessions


@cython.final
cdef class LeaseTable:
    cdef public dict _live
    cdef public object _expired, _expired_memory
    cdef public Py_ssize_t _serial

    cpdef Lease find(self, object engine_id)
    cpdef Lease owner_of(self, object engine_id)
    cpdef bint has_expired(self, object engine_id) except -1
    cpdef Lease get(self, object engine_id)
