"""kvcache service: the process that owns an LLM deployment's KV memory (see DESIGN.md)."""

__version__ = "0.1.0"
