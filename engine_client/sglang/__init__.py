"""SGLang on kvcache: a tree cache SGLang 0.5.23 loads by name, no fork (docs/design.md §14, docs/sglang.md).

    KVCACHE_TARGET=127.0.0.1:50051 SGLANG_USE_CPU_ENGINE=1 python -m sglang.launch_server --model-path DIR \
        --device cpu --attention-backend torch_native --radix-cache-backend kvcache [--enable-streaming-session]

Installing kvcache next to SGLang declares the entry point `kvcache = engine_client.sglang.plugin:register` in
SGLang's plugin group `sglang.srt.plugins`; SGLang's processes call it at start, and it registers the
`kvcache` radix-cache backend (`backend.KVCacheRadixCache`, a `UnifiedRadixCache`) and the two scheduler
hooks that end each step's kvcache work. Settings come from the environment: `KVCACHE_TARGET`,
`KVCACHE_TOKEN`, `KVCACHE_ENGINE_ID` (`link.BackendConfig`). Importing this package imports no SGLang.
"""
