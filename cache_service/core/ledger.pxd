# C types of ledger.py for the compiled build (Cython pure-Python mode; see cache_service/native.py).
cimport cython


@cython.final
cdef class PageLedger:
    cdef public Py_ssize_t usable_pages
    cdef public list counts

    @cython.locals(c=list)
    cpdef move(self, Py_ssize_t n, Py_ssize_t src, Py_ssize_t dst)


@cython.final
cdef class Counters:
    cdef public Py_ssize_t demoted_sessions, duplicate_pages, expired_leases, miss_tokens, prefix_hit_tokens
    cdef public Py_ssize_t reaped_sessions, session_hit_tokens, session_kv_tokens, session_tokens
    cdef public Py_ssize_t adopted_sessions, expired_parked_sessions, parked_sessions
    cdef public Py_ssize_t demoted_session_pages, demoted_parent_pages
