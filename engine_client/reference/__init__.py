"""Reference decoder-only transformer that reads and writes its KV through a kvcache pool."""

from engine_client.reference.model import ModelConfig, ReferenceModel, check_pool_layout, dtype_name

__all__ = ["ModelConfig", "ReferenceModel", "check_pool_layout", "dtype_name"]
