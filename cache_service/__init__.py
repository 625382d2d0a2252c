"""kvcache service: the process that owns an LLM deployment's KV memory (see docs/design.md)."""

from cache_service import native as _native

_native.install()  # before any compiled module is imported: a stale build never loads (see native.py)

__version__ = "0.1.0"
