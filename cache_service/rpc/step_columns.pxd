# C types of step_columns.py for the compiled build (Cython pure-Python mode; see cache_service/native.py).
# The number columns, in and out, are typed views of their arrays: an op's fields are read and its results
# written as C numbers.
cimport cython

from cache_service.core.ops cimport Ops
from cache_service.core.slot cimport SessionSlot


@cython.locals(n=Py_ssize_t, i=Py_ssize_t, k=int, f=int, ntok=Py_ssize_t, start=Py_ssize_t, pos=Py_ssize_t,
               kinds=bytes, flags=bytes, tokens=bytes, negative=bint, ops=Ops, s=SessionSlot, sids=list,
               page_parts=list, win_parts=list, window=object, opened=list, view=memoryview,
               epochs=cython.ulonglong[:], counts=cython.int[:], turns=cython.uint[:], timeouts=cython.double[:],
               reuse=object,
               codes=cython.int[:], r_epochs=cython.ulonglong[:], r_turns=cython.uint[:], r_cached=cython.uint[:],
               r_context=cython.uint[:], r_capacity=cython.uint[:], r_offsets=cython.uint[:], r_pages=cython.uint[:],
               r_hits=cython.uint[:], r_kv=cython.uint[:], r_page_counts=cython.uint[:], r_timeouts=cython.double[:],
               r_closed=bytearray)
cpdef run_columns(core, cols, default_engine, who, Py_ssize_t max_tokens, instance_id, dict refused)
