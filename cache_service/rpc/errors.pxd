# C types of errors.py for the compiled build (Cython pure-Python mode; see cache_service/native.py): the
# serialized Status of a refused op inside a Step, written with C lengths.
cimport cython


cdef tuple _ONE_BYTE
cdef dict _KEYS
cdef bytes _ANY_HEAD


cpdef bytes _varint(Py_ssize_t n)

@cython.locals(head=bytes, metadata=dict, parts=list, k=bytes, v=bytes, v_len=bytes)
cpdef bytes _error_info(err)

@cython.locals(code=Py_ssize_t, message=bytes, info=bytes, v_code=bytes, v_msg=bytes, v_info=bytes, v_any=bytes,
               n_any=Py_ssize_t, n_status=Py_ssize_t)
cpdef Py_ssize_t add_status(list entries, err) except -1
