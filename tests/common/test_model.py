"""kvcache_common.model: a model's KV layout from its config.json, and the models a session cannot hold."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvcache_common.model import ModelConfigError, ModelLayout, UnsupportedModel, model_layout, read_model_layout

MODELS = Path(__file__).resolve().parent.parent / "models"


@pytest.mark.parametrize(("name", "layout"), [
    ("llama-3.1-8b", ModelLayout(32, 8, 128, "bfloat16", "LlamaForCausalLM")),
    ("qwen2-7b", ModelLayout(28, 4, 128, "bfloat16", "Qwen2ForCausalLM")),  # head_dim from 3584 / 28
    ("mistral-7b-v0.3", ModelLayout(32, 8, 128, "bfloat16", "MistralForCausalLM")),
    ("llava-1.5-7b", ModelLayout(32, 32, 128, "float16", "LlavaForConditionalGeneration")),  # its text_config
    # MLA: one latent of kv_lora_rank 512 + qk_rope_head_dim 64 per token and layer
    ("deepseek-v3", ModelLayout(61, 1, 576, "bfloat16", "DeepseekV3ForCausalLM", "mla")),
])
def test_the_layout_of_a_full_attention_or_mla_model(name: str, layout: ModelLayout) -> None:
    assert read_model_layout(MODELS / f"{name}.json") == layout


def test_a_model_directory_is_read_through_its_config_json(tmp_path: Path) -> None:
    shutil.copy(MODELS / "llama-3.1-8b.json", tmp_path / "config.json")
    layout = read_model_layout(tmp_path)
    assert layout.flags() == "--num-layers 32 --num-kv-heads 8 --head-dim 128 --dtype bfloat16"
    assert layout.describe() == "32 layers, 8 kv heads x 128, bfloat16"


@pytest.mark.parametrize(("name", "reason"), [
    ("mistral-7b-v0.1", "MistralForCausalLM uses sliding-window attention (sliding_window=4096, context 32768): a "
                        "kvcache session keeps per-head K and V for every position, beyond the window too; serve a "
                        "variant without a window (sliding_window: null)"),
    ("gemma-3-4b-text", "Gemma3ForCausalLM has sliding_attention layers (sliding_window=1024): a kvcache session "
                        "keeps per-head K and V for every position, so only a stack of full-attention layers fits"),
    ("qwen3-next-80b", "Qwen3NextForCausalLM has linear_attention layers: a kvcache session keeps per-head K and V "
                       "for every position, so only a stack of full-attention layers fits"),
    ("jamba-mini", "JambaForCausalLM has mamba layers: a kvcache session keeps per-head K and V for every position, "
                   "so only a stack of full-attention layers fits"),
    ("t5-small", "T5ForConditionalGeneration is an encoder-decoder model: its cross-attention K/V comes from the "
                 "encoder's output, and a kvcache session keeps per-head K and V for every position of one decoder "
                 "sequence"),
])
def test_attention_a_session_cannot_hold_is_refused_with_the_reason(name: str, reason: str) -> None:
    with pytest.raises(UnsupportedModel) as err:
        read_model_layout(MODELS / f"{name}.json")
    assert str(err.value) == reason


def test_an_mla_model_is_described_with_the_flags_that_fit_it() -> None:
    layout = read_model_layout(MODELS / "deepseek-v3.json")
    assert layout.flags() == "--attention mla --num-layers 61 --num-kv-heads 1 --head-dim 576 --dtype bfloat16"
    assert layout.describe() == "61 layers, MLA latent 576 (its halves in the K and V planes), bfloat16"
    config = json.loads((MODELS / "deepseek-v3.json").read_text())
    with pytest.raises(ModelConfigError) as err:
        model_layout({k: v for k, v in config.items() if k != "qk_rope_head_dim"})
    assert str(err.value) == "missing the MLA rope head dim (qk_rope_head_dim)"


def test_a_window_as_long_as_the_context_is_full_attention() -> None:
    config = json.loads((MODELS / "mistral-7b-v0.1.json").read_text())
    assert model_layout({**config, "sliding_window": 32768}).num_layers == 32
    assert model_layout({**config, "use_sliding_window": False}).num_layers == 32  # Qwen2's switch


@pytest.mark.parametrize(("config", "message"), [
    ({"num_attention_heads": 8, "hidden_size": 512},
     "missing the layer count (num_hidden_layers / n_layer / num_layers / n_layers)"),
    ({"num_hidden_layers": 2, "hidden_size": 512},
     "missing the attention head count (num_attention_heads / n_head / num_heads / n_heads)"),
    ({"num_hidden_layers": 2, "num_attention_heads": 8},
     "missing the hidden size (or head_dim) (hidden_size / n_embd / d_model)"),
    ({"num_hidden_layers": 0, "num_attention_heads": 8, "head_dim": 64},
     "the layer count is 0, not a positive integer"),
    ({"num_hidden_layers": 2, "num_attention_heads": 7, "hidden_size": 512},
     "hidden size 512 is not a multiple of 7 attention heads"),
])
def test_a_config_without_what_the_layout_needs(config: dict[str, object], message: str) -> None:
    with pytest.raises(ModelConfigError) as err:
        model_layout(config)
    assert str(err.value) == message


def test_unreadable_configs_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match=rf"^{tmp_path} has no config.json \(give a Hugging Face model "):
        read_model_layout(tmp_path)
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ModelConfigError, match=rf"^{bad} is not JSON "):
        read_model_layout(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ModelConfigError, match=rf"^{bad} is not a JSON object$"):
        read_model_layout(bad)
    bad.write_text('{"num_hidden_layers": 2}')
    with pytest.raises(ModelConfigError, match=rf"^{bad}: missing the attention head count"):
        read_model_layout(bad)


def test_gpt2_and_falcon_names() -> None:
    gpt2 = {"architectures": ["GPT2LMHeadModel"], "n_layer": 12, "n_head": 12, "n_embd": 768,
            "torch_dtype": "float32"}
    assert model_layout(gpt2) == ModelLayout(12, 12, 64, "float32", "GPT2LMHeadModel")
    falcon = {"model_type": "falcon", "num_hidden_layers": 32, "num_attention_heads": 71, "hidden_size": 4544,
              "multi_query": True, "torch_dtype": "bfloat16"}
    assert model_layout(falcon) == ModelLayout(32, 1, 64, "bfloat16", "falcon")
    assert model_layout({**gpt2, "torch_dtype": "auto"}).dtype is None  # --dtype decides
