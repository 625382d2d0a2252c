# C types of radix_node.py for the compiled build (Cython pure-Python mode; see cache_service/native.py).
cimport cython


@cython.final
cdef class RadixNode:
    cdef public object key, pages, salt
    cdef public RadixNode parent, forward
    cdef public dict children
    cdef public Py_ssize_t id, lock_ref, tick, hits, heap_ver, klass, guard
