"""What every engine's kvcache integration does the same way, whatever the engine (docs/design.md §7, §14).

- `ops`: a scheduler step's ops queued in one `StepBatch`, each with the callback that takes its outcome,
  sent together in one `Step` (lookups batched per step, never one RPC per request).
- `turns`: a session as a scheduler sees it (page table, committed tokens, turn in flight) and whether a
  turn's prompt extends its committed history.
- `plans`: a request's transfer plan: which positions it loads and saves, what is confirmed, when its
  session must grow.
- `outage`: kvcache up and down, one warning per outage.

No engine is imported here: vLLM (`engine_client.vllm`) and SGLang (`engine_client.sglang`) build on these.
"""
