# C types of lifecycle.py for the compiled build (Cython pure-Python mode; see cache_service/native.py).
cimport cython

from cache_service.core.leases cimport Lease, LeaseTable
from cache_service.core.ledger cimport Counters
from cache_service.core.pages cimport PageAllocator
from cache_service.core.radix cimport RadixTree
from cache_service.core.radix_node cimport RadixNode
from cache_service.core.sessions cimport SessionTable
from cache_service.core.slot cimport SessionSlot, Slots
from cache_service.core.turns cimport Turns


@cython.final
cdef class Lifecycle:
    cdef public object config, _clock
    cdef public SessionTable _sessions
    cdef public LeaseTable _leases
    cdef public Slots _slots
    cdef public Turns _turns
    cdef public RadixTree _radix
    cdef public PageAllocator _pages
    cdef public Counters _c

    @cython.locals(cached=Py_ssize_t, cache=bint, node=RadixNode, lease=Lease)
    cpdef Py_ssize_t finish_close(self, SessionSlot s, Py_ssize_t mode, str reason=*) except -1
