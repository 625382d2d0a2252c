# C types of errors.py for the compiled build (Cython pure-Python mode; see cache_service/native.py): the
# serialized Status of a refused op inside a Step, written with C lengths.
cimport cython


cdef tuple _VARINT1
cdef dict _KEYS
cdef bytes _ANY_HEAD


@cython.locals(out=bytearray)
cpdef bytes _varint(Py_ssize_t n)

@cython.locals(size=Py_ssize_t)
cpdef Py_ssize_t _varint_len(Py_ssize_t n)

@cython.locals(head=bytes, metadata=dict, parts=list, k=bytes, v=bytes, n_v=Py_ssize_t, n_entry=Py_ssize_t)
cpdef bytes _error_info(err)

@cython.locals(code=Py_ssize_t, message=bytes, info=bytes, n_info=Py_ssize_t, n_any=Py_ssize_t, n_msg=Py_ssize_t,
               n_status=Py_ssize_t)
cpdef Py_ssize_t add_status(list entries, err) except -1
