"""What vLLM 0.32's KV connector interface hands a connector on a hybrid Gated DeltaNet model, and whether a
recurrent-state snapshot loaded through it reaches the forward pass (docs/attention-shapes.md, "Recurrent state").

Run with the vLLM venv's python (a few minutes on the CPU build; one engine, five requests of a block and 44 tokens):

    LD_PRELOAD=.venv-vllm/lib/libiomp5.so VLLM_ENABLE_V1_MULTIPROCESSING=0 PYTHONPATH=scripts:. \
        .venv-vllm/bin/python -m vllm_recurrent_probe /tmp/probe

It saves a tiny random Qwen3-Next-style checkpoint (3 Gated DeltaNet layers, 1 full-attention layer, bfloat16),
starts vLLM with `ProbeConnector` (this module: a `SupportsHMA` connector that records what it is given and keeps
copies of blocks in memory; not kvcache's connector), and runs one prompt five ways, vLLM's prefix cache reset
before each: computed (the probe saves the full-attention block and the state vLLM offers at the first block
boundary), computed again, then three times with the probe reporting that boundary as an external hit and loading
the saved blocks: synchronously into the hit's blocks, synchronously into those and the request's running state
block, and asynchronously into the hit's blocks. Prints one JSON object; `probe.jsonl` in the output folder holds
every call the connector saw.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.v1.kv_cache_interface import MambaSpec

_LOG = Path(os.environ.get("PROBE_LOG", "/tmp/probe.jsonl"))
_STORE: dict[tuple[str, str], torch.Tensor] = {}
"""(layer, key) -> a saved block (scheduler and worker share this process: VLLM_ENABLE_V1_MULTIPROCESSING=0)."""


def _log(event: str, **data: Any) -> None:
    with _LOG.open("a") as f:
        f.write(json.dumps({"event": event, **data}, default=str) + "\n")


@dataclass
class _Meta(KVConnectorMetadata):
    saves: list[tuple[int, int, str]] = field(default_factory=list)
    """(group, block id, key): copy the block of every layer of the group after the forward."""
    loads: list[tuple[int, int, str]] = field(default_factory=list)
    """(group, block id, key): write the saved block into every layer of the group."""
    async_done: list[str] = field(default_factory=list)


class ProbeConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        groups = kv_cache_config.kv_cache_groups
        self._mamba = [g for g, grp in enumerate(groups) if isinstance(grp.kv_cache_spec, MambaSpec)]
        self._attention = [g for g in range(len(groups)) if g not in self._mamba]
        self._block = groups[self._attention[0]].kv_cache_spec.block_size
        self._layers = {g: list(grp.layer_names) for g, grp in enumerate(groups)}
        self._blocks: dict[str, tuple[list[int], ...]] = {}
        self._pending: dict[str, tuple[str, int]] = {}
        self._modes: dict[str, str] = {}
        self._planned: set[str] = set()
        self._caches: dict[str, torch.Tensor] = {}
        cache = vllm_config.cache_config
        _log("init", role=role.name, mamba_cache_mode=cache.mamba_cache_mode, block_size=cache.block_size,
             mamba_block_size=cache.mamba_block_size, mamba_ssm_cache_dtype=cache.mamba_ssm_cache_dtype,
             prefix_caching=cache.enable_prefix_caching,
             groups=[repr(grp.kv_cache_spec) for grp in groups], layers=self._layers,
             prefix_cacheable_group_ids=list(kv_cache_config.prefix_cacheable_group_ids))

    # scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        mode = (request.kv_transfer_params or {}).get("probe", "")
        self._modes[request.request_id] = mode
        hit = self._block if mode.startswith("hit") and num_computed_tokens == 0 else 0
        _log("get_num_new_matched_tokens", req=request.request_id, mode=mode, local=num_computed_tokens, hit=hit)
        return hit, bool(hit) and mode == "hit-async"

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        ids = blocks.get_block_ids()
        _log("update_state_after_alloc", req=request.request_id, external=num_external_tokens, block_ids=ids)
        if num_external_tokens and request.request_id not in self._planned:
            self._planned.add(request.request_id)
            self._pending[request.request_id] = ((request.kv_transfer_params or {})["probe"], num_external_tokens)
            self._blocks[request.request_id] = ids

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = _Meta()
        state = scheduler_output.kv_connector_block_state
        offers = dict(state.boundary_state_offloads) if state is not None else {}
        if offers:
            _log("boundary_state_offloads", offers=offers)
        for req, entries in offers.items():
            for group, block, tokens in entries:
                if tokens == self._block and self._modes.get(req) == "save":
                    meta.saves.append((group, block, "state"))
                    ids = state.get_block_ids(req)
                    meta.saves += [(g, ids[g][0], "kv") for g in self._attention]
        for req, (mode, hit) in list(self._pending.items()):
            ids = self._blocks[req]
            scheduled = scheduler_output.num_scheduled_tokens.get(req, 0)
            if mode != "hit-async" and not scheduled:
                continue
            del self._pending[req]
            hit_block = hit // self._block - 1
            meta.loads += [(g, ids[g][hit_block], "kv") for g in self._attention]
            meta.loads += [(g, ids[g][hit_block], "state") for g in self._mamba]
            if mode == "hit-running":
                running = -(-(hit + scheduled) // self._block) - 1
                meta.loads += [(g, ids[g][running], "state") for g in self._mamba]
            if mode == "hit-async":
                meta.async_done.append(req)
            _log("plan_load", req=req, mode=mode, scheduled=scheduled, loads=meta.loads)
        return meta

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        _log("request_finished_all_groups", req=request.request_id, block_ids=block_ids)
        return False, None

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        _log("request_finished", req=request.request_id, block_ids=block_ids)
        return False, None

    # worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._caches = dict(kv_caches)
        _log("register_kv_caches", layers={name: {"type": type(t).__name__, "shape": list(t.shape),
                                                  "dtype": str(t.dtype), "stride": list(t.stride()),
                                                  "data_ptr": t.data_ptr()} for name, t in kv_caches.items()})

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, _Meta)
        for group, block, key in meta.loads:
            for layer in self._layers[group]:
                self._caches[layer][block].copy_(_STORE[(layer, key)])
        self._done = set(meta.async_done)
        if meta.loads:
            _log("start_load_kv", loads=meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, _Meta)
        for group, block, key in meta.saves:
            for layer in self._layers[group]:
                _STORE[(layer, key)] = self._caches[layer][block].clone()
        if meta.saves:
            _log("wait_for_save", saves=meta.saves)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done, self._done = getattr(self, "_done", set()), set()
        return None, done or None


def _save_model(out: Path) -> Path:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                             num_attention_heads=2, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
                             linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
                             linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=64, shared_expert_intermediate_size=64,
                             layer_types=["linear_attention"] * 3 + ["full_attention"], max_position_embeddings=4096,
                             tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen3NextForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    return out


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    _LOG.unlink(missing_ok=True)
    model = _save_model(out / "model")
    from vllm import LLM, SamplingParams
    from vllm.engine.arg_utils import EngineArgs

    common = {"model": str(model), "skip_tokenizer_init": True, "dtype": "bfloat16", "max_model_len": 1024,
              "enforce_eager": True, "kv_cache_memory_bytes": 256 << 20, "max_num_seqs": 4, "seed": 0}
    transfer = {"kv_connector": "ProbeConnector", "kv_connector_module_path": "vllm_recurrent_probe",
                "kv_role": "kv_both"}
    found: dict[str, Any] = {}
    off = EngineArgs(**common, enable_prefix_caching=False, kv_transfer_config=transfer).create_engine_config()
    found["prefix_caching_off"] = {"mamba_cache_mode": off.cache_config.mamba_cache_mode,
                                   "mamba_block_size": off.cache_config.mamba_block_size}
    llm = LLM(**common, enable_prefix_caching=True, kv_transfer_config=transfer)
    block = llm.llm_engine.vllm_config.cache_config.block_size
    found["block_size"] = block
    prompt = {"prompt_token_ids": [(7 * i + 3) % 500 + 2 for i in range(block + 44)]}
    for mode in ("save", "again", "hit-sync", "hit-running", "hit-async"):
        llm.reset_prefix_cache()
        params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=0,
                                extra_args={"kv_transfer_params": {"probe": mode}})
        o = llm.generate([prompt], params, use_tqdm=False)[0]
        c = o.outputs[0]
        found[mode] = {"tokens": list(c.token_ids), "num_cached_tokens": o.num_cached_tokens,
                       "logprobs": [round(next(iter(lp.values())).logprob, 6) for lp in c.logprobs]}
    base = found["save"]
    for mode in ("again", "hit-sync", "hit-running", "hit-async"):
        found[mode]["equals_computed"] = found[mode]["logprobs"] == base["logprobs"] and \
            found[mode]["tokens"] == base["tokens"]
    print(json.dumps(found))


if __name__ == "__main__":
    main()
