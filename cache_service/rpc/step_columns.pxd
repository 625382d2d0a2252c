# C types of step_columns.py for the compiled build (Cython pure-Python mode; see cache_service/native.py).
cimport cython

from cache_service.core.ops cimport Ops
from cache_service.core.slot cimport SessionSlot


@cython.locals(n=Py_ssize_t, i=Py_ssize_t, k=int, f=int, ntok=Py_ssize_t, start=Py_ssize_t, pos=Py_ssize_t,
               kinds=bytes, flags=bytes, tokens=bytes, negative=bint, ops=Ops, s=SessionSlot, sids=list,
               page_parts=list, opened=list, view=memoryview)
cpdef run_columns(core, cols, default_engine, who, Py_ssize_t max_tokens, instance_id, tally)
