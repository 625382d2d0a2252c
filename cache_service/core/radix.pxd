# C types of radix.py for the compiled build (Cython pure-Python mode; see cache_service/native.py).
cimport cython

from cache_service.core.ledger cimport PageLedger
from cache_service.core.radix_node cimport RadixNode


@cython.final
cdef class RadixTree:
    cdef public object _leaves, _free_pages, changes, evict_hook, usable, classes
    cdef public Py_ssize_t page_size, page_bytes, _next_id, _tick, evicted_pages_total
    cdef public PageLedger _ledger
    cdef public list _counts
    cdef public dict _roots
    cdef public list evicted_by_class

    @cython.locals(root=RadixNode, node=RadixNode, matched=Py_ssize_t, into=Py_ssize_t, cut=Py_ssize_t)
    cpdef match(self, object salt, object key, bint lock=*, bint touch=*, Py_ssize_t end=*)

    @cython.locals(root=RadixNode, node=RadixNode, matched=Py_ssize_t, into=Py_ssize_t)
    cpdef Py_ssize_t matched_pages(self, object salt, object key, Py_ssize_t end=*) except -1

    @cython.locals(num_pages=Py_ssize_t, root=RadixNode, node=RadixNode, matched=Py_ssize_t, into=Py_ssize_t,
                   n=RadixNode, leaf=RadixNode)
    cpdef insert(self, object salt, object key, object pages, RadixNode below=*, Py_ssize_t src=*)

    @cython.locals(n=RadixNode, counts=list, k=Py_ssize_t)
    cpdef lock(self, RadixNode node)

    @cython.locals(n=RadixNode, counts=list, k=Py_ssize_t)
    cpdef unlock(self, RadixNode node)

    @cython.locals(root=RadixNode)
    cpdef RadixNode find(self, object salt, object key, Py_ssize_t end=*)

    cpdef Py_ssize_t _new_id(self)

    @cython.locals(pb=Py_ssize_t, n=Py_ssize_t, node=RadixNode, child=RadixNode, pos=Py_ssize_t, into=Py_ssize_t,
                   clen=Py_ssize_t, span=Py_ssize_t, same=bint, common=Py_ssize_t, children=dict)
    cpdef tuple _walk(self, RadixNode root, object key, bint touch, Py_ssize_t end=*)

    @cython.locals(n=RadixNode, parts=list)
    cpdef object path_pages(self, RadixNode node, object into=*, RadixNode above=*)

    cpdef object _matched_pages(self, RadixNode node, Py_ssize_t into, Py_ssize_t matched, RadixNode above=*)

    @cython.locals(parent=RadixNode, upper=RadixNode, cut=Py_ssize_t)
    cpdef RadixNode _split(self, RadixNode node, Py_ssize_t at)

    cpdef bint _is_evictable_leaf(self, RadixNode node)
    cpdef _update_leaf(self, RadixNode node)
