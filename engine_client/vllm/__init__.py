"""vLLM on kvcache: `KVCacheConnector`, a vLLM v1 KV connector loaded by an unmodified vLLM.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVCacheConnector",
        "kv_connector_module_path": "engine_client.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"kvcache_target": "127.0.0.1:50051"}}'

or `LLM(model, kv_transfer_config={...the same...})`. Each request's prompt is a kvcache regular session
(or, with `kv_transfer_params={"kvcache_session_id": "<id>"}`, a turn of that streaming session): the
tokens kvcache holds beyond vLLM's own prefix cache are loaded into vLLM's blocks, and the KV vLLM computes
is saved into the session's pages and committed when the request finishes, so every engine on the same
kvcache reuses it. Any tensor-parallel size: the pool holds all the model's KV heads and each rank copies its
own. `kv_role` `kv_producer` (a prefill engine) saves only and returns `do_remote_prefill` params that a
`kv_consumer` (a decode engine, loads only) takes. See docs/design.md §7, docs/vllm.md and the README's
vLLM section.

Modules: `config` (the `kv_connector_extra_config` keys), `scheduler` (the scheduler side's facade over
`admission`, `turns`, `plans`, `reports`, `state` and `params`; the engine-neutral parts are
`engine_client.scheduling`) and `sender`,
`worker` and `transfer` (the worker side: pool mapping, layouts, copies), `counters` and `stats`
(metrics), `connector` (the class vLLM loads), `driver` (a vLLM engine behind a JSON-lines pipe, for the
demo, the benchmark and the tests) and `demo` (`make vllm-demo`). Importing this package does not import
vLLM; `KVCacheConnector` does, on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["KVCacheConnector"]

if TYPE_CHECKING:
    from engine_client.vllm.connector import KVCacheConnector
else:
    def __getattr__(name: str) -> object:
        if name == "KVCacheConnector":
            from engine_client.vllm.connector import KVCacheConnector

            globals()[name] = KVCacheConnector
            return KVCacheConnector
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
