# C types of pages.py for the compiled build (Cython pure-Python mode; see cache_service/native.py).
cimport cython

from cache_service.core.ledger cimport PageLedger


@cython.final
cdef class PageAllocator:
    cdef public object _ids, _stack, _view, quarantine, _quarantine_until, window
    cdef public bytearray _state
    cdef public PageLedger _ledger, ledger
    cdef public Py_ssize_t _num_pages

    @cython.locals(counts=list, top=Py_ssize_t, state=bytearray)
    cpdef object take(self, object n, Py_ssize_t to)

    @cython.locals(counts=list, top=Py_ssize_t, n=Py_ssize_t, state=bytearray, quarantine=bint)
    cpdef give(self, object pages, Py_ssize_t src)
