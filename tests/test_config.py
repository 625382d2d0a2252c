"""Service configuration: byte sizes, precedence, validation messages that name the flag."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from cache_service.app import core_config, tier_namespace
from cache_service.config import (
    FLAGS,
    ConfigError,
    ServiceConfig,
    add_serve_arguments,
    config_from,
    parse_bytes,
    step_socket_path,
)
from kvcache_common.layout import PoolLayout


@pytest.mark.parametrize(("text", "value"), [
    ("4096", 4096), ("512Mi", 512 * 2**20), ("2Gi", 2 * 2**30), ("1G", 10**9), ("1.5Ki", 1536), ("64MiB", 64 * 2**20),
    ("10k", 10_000),
])
def test_parse_bytes(text: str, value: int) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "12xx", "-1Mi", "Mi"])
def test_parse_bytes_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="not a byte size"):
        parse_bytes(text)


def parse(argv: list[str], env: dict[str, str] | None = None) -> ServiceConfig:
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return config_from(vars(p.parse_args(argv)), env or {})


def test_defaults_are_the_embedded_quick_start() -> None:
    cfg = parse([])
    assert (cfg.listen, cfg.backend, cfg.resolved_num_pages) == ("127.0.0.1:50051", "auto", 1024)
    assert cfg.layout().size_bytes == 32 * 2**20
    assert core_config(cfg, cfg.resolved_num_pages).session_budget_pages == 818  # 0.8 of 1023 usable pages


def test_command_line_beats_environment_beats_default() -> None:
    cfg = parse(["--page-size", "8"], {"KVCACHE_PAGE_SIZE": "32", "KVCACHE_HEAD_DIM": "128"})
    assert (cfg.page_size, cfg.head_dim, cfg.num_layers) == (8, 128, 2)


def test_pool_bytes_sizes_the_pool_in_whole_pages() -> None:
    cfg = parse(["--pool-bytes", "1Mi", "--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "64",
                 "--page-size", "16", "--dtype", "float16"])
    assert cfg.bytes_per_page == 4096 and cfg.resolved_num_pages == 256


def test_a_budget_of_zero_or_one_means_none() -> None:
    for fraction in ("0", "1"):
        cfg = parse(["--session-budget-fraction", fraction])
        assert core_config(cfg, cfg.resolved_num_pages).session_budget_pages == 0


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"page_size": 0}, "--page-size: must be >= 1, got 0"),
    ({"lease_ttl": 0}, "--lease-ttl: must be > 0 seconds, got 0"),
    ({"session_timeout": -1}, "--session-timeout: must be >= 0 seconds, got -1"),
    ({"metrics_port": 70000}, "--metrics-port: not a port: 70000"),
    ({"listen": "unix:relative.sock"}, "--listen: 'unix:relative.sock' is not host:port or unix:/absolute/path"),
    ({"shm_prefix": "a/b"}, "--shm-prefix: must be a plain file name part"),
    ({"max_message_bytes": 10}, "--max-message-bytes: must be >= 4096 bytes, got 10"),
    ({"pool_bytes": 1000}, "--pool-bytes: 1000 B holds fewer than 2 pages of 32.0 KiB"),
    ({"tls_cert": "/tls/server.pem"}, "--tls-cert: needs --tls-key (the certificate's private key)"),
    ({"tls_key": "/tls/server.key"}, "--tls-key: needs --tls-cert (the certificate it belongs to)"),
    ({"tls_client_ca": "/tls/ca.pem"},
     "--tls-client-ca: needs --tls-cert and --tls-key: mutual TLS is TLS with client certificates"),
    ({"tls_client_ca": "/tls/ca.pem", "tls_key": "/tls/server.key"},
     "--tls-key: needs --tls-cert (the certificate it belongs to)"),
    ({"tier": "s3"}, "--tier: 's3' is not one of none, disk, mooncake"),
    ({"tier": "disk"}, "--tier-dir: --tier disk needs a directory"),
    ({"tier_dir": "/t"}, "--tier-dir: needs --tier disk (the tier is none)"),
    ({"tier": "mooncake", "mooncake_master": "m:1", "tier_dir": "/t"},
     "--tier-dir: needs --tier disk (the tier is mooncake)"),
    ({"tier_bytes": 1 << 30}, "--tier-bytes: needs --tier disk (the tier is none)"),
    ({"tier": "disk", "tier_dir": "/t", "tier_bytes": -1}, "--tier-bytes: must be >= 0 bytes, got -1"),
    ({"tier_timeout": 0.0}, "--tier-timeout: must be > 0 seconds, got 0.0"),
    ({"tier_timeout": float("nan")}, "--tier-timeout: must be > 0 seconds, got nan"),
    ({"tier_queue_pages": 0}, "--tier-queue-pages: must be >= 1, got 0"),
    ({"tier_watermark": 0.0}, "--tier-watermark: must be in (0, 1], got 0.0"),
    ({"tier_watermark": 1.5}, "--tier-watermark: must be in (0, 1], got 1.5"),
    ({"tier_pin_fraction": float("nan")}, "--tier-pin-fraction: must be in (0, 1], got nan"),
    ({"tier_policy": "write-around"}, "--tier-policy: 'write-around' is not one of write-back, write-through"),
    ({"tier_staging_bytes": -1}, "--tier-staging-bytes: must be >= 0 bytes, got -1"),
    ({"tier_tainted_quarantine": -1.0}, "--tier-tainted-quarantine: must be >= 0 seconds, got -1.0"),
    ({"tier": "mooncake"}, "--mooncake-master: --tier mooncake needs the master's host:port"),
    ({"mooncake_master": "m:1"}, "--mooncake-master: needs --tier mooncake (the tier is none)"),
    ({"tier": "mooncake", "mooncake_master": "m"}, "--mooncake-master: 'm' is not host:port"),
    ({"tier": "mooncake", "mooncake_master": "m:0"}, "--mooncake-master: 'm:0' is not host:port"),
    ({"mooncake_metadata": "etcd"},
     "--mooncake-metadata: 'etcd' is not P2PHANDSHAKE or a URL such as http://host:8080/metadata"),
    ({"mooncake_protocol": "t c p"}, "--mooncake-protocol: 't c p' is not a protocol name such as tcp or rdma"),
    ({"mooncake_segment_bytes": 8 << 20},
     "--mooncake-segment-bytes: 0 or at least 16Mi (Mooncake refuses smaller segments), got 8388608"),
    ({"mooncake_local_hostname": ""}, "--mooncake-local-hostname: '' is not a host name or address"),
])
def test_validation_names_the_flag(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        ServiceConfig(**kwargs)  # type: ignore[arg-type]
    assert str(err.value) == message


def test_every_flag_is_a_config_field_with_a_kvcache_env_var() -> None:
    fields = set(ServiceConfig.__dataclass_fields__)
    assert {f.dest for f in FLAGS} == fields - {"model_layout"}  # what --model read, not a setting
    assert all(f.env == "KVCACHE_" + f.dest.upper() for f in FLAGS)
    defaults = ServiceConfig()
    assert all(getattr(defaults, f.dest) == f.default for f in FLAGS)


def test_tier_flags_parse_from_the_command_line_and_the_environment() -> None:
    cfg = parse(["--tier", "disk", "--tier-dir", "/var/lib/kv", "--tier-bytes", "50Gi", "--tier-pin-fraction", "0.5"],
                {"KVCACHE_TIER_TIMEOUT": "0.25", "KVCACHE_TIER_QUEUE_PAGES": "64", "KVCACHE_TIER_WATERMARK": "0.75",
                 "KVCACHE_TIER_POLICY": "write-through", "KVCACHE_TIER_STAGING_BYTES": "1Gi",
                 "KVCACHE_TIER_TAINTED_QUARANTINE": "300"})
    assert (cfg.tier, cfg.tier_dir, cfg.tier_bytes, cfg.tier_timeout, cfg.tier_queue_pages, cfg.tier_watermark,
            cfg.tier_pin_fraction, cfg.tier_policy, cfg.tier_staging_bytes) == (
        "disk", "/var/lib/kv", 50 * 2**30, 0.25, 64, 0.75, 0.5, "write-through", 1 << 30)
    core = core_config(cfg, 1024)  # the shares and the policy reach the core (none is its default here)
    assert (core.tier_watermark, core.tier_pin_fraction, core.tier_policy, core.tier_tainted_quarantine_seconds) == (
        0.75, 0.5, "write-through", 300.0)
    assert parse([], {}).tier_staging_bytes == 256 << 20
    cfg = parse(["--tier", "mooncake", "--mooncake-master", "10.0.0.2:50051", "--mooncake-segment-bytes", "1Gi"],
                {"KVCACHE_MOONCAKE_LOCAL_HOSTNAME": "10.0.0.9", "KVCACHE_MOONCAKE_PROTOCOL": "rdma"})
    assert (cfg.mooncake_master, cfg.mooncake_segment_bytes, cfg.mooncake_local_hostname, cfg.mooncake_protocol,
            cfg.mooncake_metadata) == ("10.0.0.2:50051", 2**30, "10.0.0.9", "rdma", "P2PHANDSHAKE")
    with pytest.raises(ConfigError, match=r"KVCACHE_TIER='tape': must be one of none, disk, mooncake"):
        parse([], {"KVCACHE_TIER": "tape"})


def test_the_tier_choices_are_the_tier_registry() -> None:
    from cache_service.config import TIER_CHOICES
    from cache_service.tier import BACKENDS
    from cache_service.tier import TIER_CHOICES as REGISTRY_CHOICES

    assert TIER_CHOICES == REGISTRY_CHOICES == ("none", *BACKENDS)


def test_tls_flags_name_files_that_start_up_reads() -> None:
    """Config only pairs the TLS flags; reading and checking the files is start-up's (cache_service.app)."""
    cfg = parse(["--tls-cert", "/nonexistent/server.pem", "--tls-key", "/nonexistent/server.key"],
                {"KVCACHE_TLS_CLIENT_CA": "/nonexistent/ca.pem"})
    assert (cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca) == (
        "/nonexistent/server.pem", "/nonexistent/server.key", "/nonexistent/ca.pem")


# ------------------------------------------------------------------------------------------ --model

MODELS = Path(__file__).resolve().parent / "models"


@pytest.mark.parametrize(("name", "layout"), [
    ("llama-3.1-8b", (32, 8, 128, "bfloat16")),
    ("qwen2-7b", (28, 4, 128, "bfloat16")),
    ("mistral-7b-v0.3", (32, 8, 128, "bfloat16")),
])
def test_model_sets_the_layout(name: str, layout: tuple[int, int, int, str]) -> None:
    cfg = parse(["--model", str(MODELS / f"{name}.json"), "--pool-bytes", "1Gi"])
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.dtype) == layout
    layers, heads, dim, _ = layout
    assert cfg.model_layout is not None and cfg.layout().bytes_per_page == layers * heads * dim * 2 * 2 * 16


def test_model_from_the_environment_and_an_explicit_kv_dtype() -> None:
    cfg = parse(["--dtype", "float16"], {"KVCACHE_MODEL": str(MODELS / "llama-3.1-8b.json")})
    assert (cfg.num_layers, cfg.dtype) == (32, "float16")  # the KV element type may differ from the weights'


@pytest.mark.parametrize(("argv", "env", "message"), [
    (["--num-layers", "2"], {}, "--num-layers: 2 disagrees with --model {m} (num-layers 32); leave it out and the "
                                "model's is used"),
    ([], {"KVCACHE_HEAD_DIM": "64"}, "--head-dim: 64 disagrees with --model {m} (head-dim 128); leave it out and the "
                                     "model's is used"),
])
def test_a_layout_flag_that_disagrees_with_the_model_is_refused(argv: list[str], env: dict[str, str],
                                                                 message: str) -> None:
    model = str(MODELS / "llama-3.1-8b.json")
    with pytest.raises(ConfigError) as err:
        parse(["--model", model, *argv], env)
    assert str(err.value) == message.format(m=model)


def test_an_agreeing_layout_flag_is_fine_and_a_direct_config_reads_the_model_too() -> None:
    model = str(MODELS / "llama-3.1-8b.json")
    assert parse(["--model", model, "--num-layers", "32"]).num_layers == 32
    direct = ServiceConfig(model=model, pool_bytes=1 << 30)
    assert (direct.num_layers, direct.num_kv_heads, direct.head_dim, direct.dtype) == (32, 8, 128, "bfloat16")
    with pytest.raises(ConfigError, match=r"^--num-kv-heads: 2 disagrees"):
        ServiceConfig(model=model, num_kv_heads=2)  # a field other than its default was asked for


def test_an_mla_model_builds_an_mla_pool_and_the_flags_describe_one_without_it() -> None:
    model = str(MODELS / "deepseek-v3.json")
    config = parse(["--model", model, "--num-pages", "4"])
    assert config.layout() == PoolLayout(num_layers=61, num_kv_heads=1, head_dim=576, dtype="bfloat16", page_size=16,
                                         num_pages=4, attention="mla")
    flags = parse(["--attention", "mla", "--num-layers", "61", "--num-kv-heads", "1", "--head-dim", "576", "--dtype",
                   "bfloat16", "--num-pages", "4"])
    assert flags.layout() == config.layout()
    assert flags.bytes_per_page == 61 * 16 * 576 * 2
    assert parse(["--model", model, "--attention", "mla"]).attention == "mla"
    with pytest.raises(ConfigError) as err:
        parse(["--model", model, "--attention", "full"])
    assert str(err.value) == (f"--attention: full disagrees with --model {model} (attention mla); leave it out and the "
                              "model's is used")


@pytest.mark.parametrize(("argv", "message"), [
    (["--attention", "mla"], "--num-kv-heads: must be 1 with --attention mla (one latent per token), got 4"),
    (["--attention", "mla", "--num-kv-heads", "1", "--head-dim", "575"],
     "--head-dim: must be even with --attention mla (the latent's halves go in the K and V planes), got 575"),
    (["--attention", "sliding"], "--attention: 'sliding' is not one of full, mla"),
])
def test_mla_flags_that_cannot_make_a_pool(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse(argv)
    assert str(err.value) == message


def test_a_window_model_builds_a_window_pool_and_the_flags_describe_one_without_it() -> None:
    model = str(MODELS / "gemma-3-4b-text.json")
    config = parse(["--model", model, "--num-pages", "4"])
    gemma = PoolLayout(num_layers=6, num_kv_heads=4, head_dim=256, dtype="bfloat16", page_size=16, num_pages=4,
                       sliding_window=1024, window_layers=(0, 1, 2, 3, 4))
    assert config.layout() == gemma
    assert (config.sliding_window, config.window_layers) == (1024, "0-4")
    flags = parse(["--num-layers", "6", "--num-kv-heads", "4", "--head-dim", "256", "--dtype", "bfloat16",
                   "--sliding-window", "1024", "--window-layers", "0,1,2,3,4", "--num-pages", "4"])
    assert flags.layout() == gemma and flags.window_layers == "0-4"  # the list's short form
    assert flags.bytes_per_page == 6 * 2 * 16 * 4 * 256 * 2  # every layer of every page, window layers included
    assert parse(["--model", model, "--sliding-window", "1024", "--window-layers", "0-4"]).layout().groups == \
        gemma.groups
    env = parse(["--num-pages", "4"], {"KVCACHE_MODEL": model, "KVCACHE_SLIDING_WINDOW": "1024",
                                       "KVCACHE_WINDOW_LAYERS": "4,3,2,1,0"})
    assert env.layout() == gemma


def test_a_window_on_every_layer_is_the_default_of_window_layers() -> None:
    mistral = str(MODELS / "mistral-7b-v0.1.json")
    config = parse(["--model", mistral, "--num-pages", "4"])
    assert (config.sliding_window, config.window_layers) == (4096, "")
    assert config.layout().window_layers == tuple(range(32))
    assert parse(["--model", mistral, "--window-layers", "0-31"]).layout() == parse(["--model", mistral]).layout()
    flags = parse(["--sliding-window", "64", "--num-pages", "4"])
    assert flags.layout().window_layers == (0, 1) and flags.layout().describe() == (
        "2 layers, 4 kv heads x 64, float16, 16 tokens/page, sliding window 64 on every layer")


@pytest.mark.parametrize(("argv", "env", "message"), [
    (["--window-layers", "0"], {}, "--window-layers: needs --sliding-window (the window its layers attend within)"),
    ([], {"KVCACHE_WINDOW_LAYERS": "0"},
     "--window-layers: needs --sliding-window (the window its layers attend within)"),
    (["--sliding-window", "64", "--window-layers", "0-2"], {},
     "--window-layers: layer 2 is out of range (the pool has 2 layers, 0-1)"),
    (["--sliding-window", "64", "--window-layers", "0;1"], {},
     "--window-layers: not a layer list: '0;1' (use 0-based layer indices and ranges, e.g. 0-4,6-10)"),
    (["--sliding-window", "64"], {"KVCACHE_WINDOW_LAYERS": "a-b"},
     "KVCACHE_WINDOW_LAYERS: not a layer list: 'a-b' (use 0-based layer indices and ranges, e.g. 0-4,6-10)"),
    (["--sliding-window", "-1"], {}, "--sliding-window: must be >= 0, got -1"),
    (["--sliding-window", "64k"], {}, "--sliding-window: not a whole number: '64k' (e.g. 1024)"),
    (["--sliding-window", "64", "--attention", "mla", "--num-kv-heads", "1"], {},
     "--sliding-window: needs --attention full (window layers keep K and V per head), got --attention mla"),
])
def test_window_flags_that_cannot_make_a_pool(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse(argv, env)
    assert str(err.value) == message


@pytest.mark.parametrize(("argv", "message"), [
    (["--sliding-window", "64"], "--sliding-window: 64 disagrees with --model {m} (sliding-window 1024); leave it out "
                                "and the model's is used"),
    (["--window-layers", "1-5"], "--window-layers: 1-5 disagrees with --model {m} (window-layers 0-4); leave it out "
                                 "and the model's is used"),
])
def test_a_window_flag_that_disagrees_with_the_model_is_refused(argv: list[str], message: str) -> None:
    model = str(MODELS / "gemma-3-4b-text.json")
    with pytest.raises(ConfigError) as err:
        parse(["--model", model, *argv])
    assert str(err.value) == message.format(m=model)
    llama = str(MODELS / "llama-3.1-8b.json")
    with pytest.raises(ConfigError) as err:
        parse(["--model", llama, "--sliding-window", "64"])
    assert str(err.value) == (f"--sliding-window: 64 disagrees with --model {llama} (sliding-window 0); leave it out "
                              "and the model's is used")


@pytest.mark.parametrize(("name", "start"), [
    ("qwen3-next-80b", "--model: Qwen3NextForCausalLM has linear_attention layers"),
    ("missing", "--model: {m} does not exist"),
])
def test_a_model_the_pool_cannot_hold_is_refused(name: str, start: str) -> None:
    model = str(MODELS / f"{name}.json")
    with pytest.raises(ConfigError) as err:
        parse(["--model", model])
    assert str(err.value).startswith(start.format(m=model))


@pytest.mark.parametrize(("argv", "message"), [
    (["--gpu-memory-fraction", "0.5", "--num-pages", "64"],
     "--gpu-memory-fraction: set one of --num-pages, --pool-bytes and --gpu-memory-fraction"),
    (["--gpu-memory-fraction", "0.5", "--backend", "host_shm"],
     "--gpu-memory-fraction: sizes a GPU pool (cuda_ipc, cuda_vmm), not --backend host_shm; use --pool-bytes"),
    (["--gpu-memory-fraction", "1.5"], "--gpu-memory-fraction: must be in [0, 1], got 1.5"),
])
def test_gpu_memory_fraction_refusals(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse(argv)
    assert str(err.value) == message


def test_the_step_lane_is_on_by_default_beside_the_pool_file() -> None:
    """docs/design.md §10: no flag serves the lane at <--shm-dir>/<--shm-prefix>-<instance id>.step."""
    assert step_socket_path(parse([]), "0123abcd") == "/dev/shm/kvcache-0123abcd.step"
    assert step_socket_path(parse(["--shm-dir", "/run/x", "--shm-prefix", "p"]), "i") == "/run/x/p-i.step"
    assert step_socket_path(parse(["--step-socket", "/run/lane/s.sock"]), "i") == "/run/lane/s.sock"
    off = parse(["--step-lane", "false"])
    assert (off.step_lane, step_socket_path(off, "i")) == (False, "")
    assert parse([], env={"KVCACHE_STEP_LANE": "false"}).step_lane is False


@pytest.mark.parametrize(("argv", "message"), [
    (["--step-lane", "false", "--step-socket", "/run/lane/s.sock"], "--step-socket: is set but --step-lane is false"),
    (["--step-lane", "false", "--step-socket-group", "engines"],
     "--step-socket-group: is set but --step-lane is false (there is no socket to open to the group)"),
    (["--step-lane", "maybe"], "--step-lane: not a boolean: 'maybe' (use true or false)"),
])
def test_step_lane_flags_that_disagree_are_refused(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse(argv)
    assert str(err.value) == message


GEMMA_FLAGS = ["--num-layers", "6", "--num-kv-heads", "2", "--head-dim", "8", "--dtype", "float32", "--page-size", "4",
               "--sliding-window", "16", "--window-layers", "0-2,4,5"]
"""A Gemma-3-style pool (5 window layers to 1 full) of 256 B a page in one layer's K (or V) plane."""


def test_window_pages_keep_the_window_rows_apart_and_reach_the_core() -> None:
    config = parse([*GEMMA_FLAGS, "--num-pages", "10", "--window-pages", "7"])
    layout = config.layout()
    assert layout == PoolLayout(num_layers=6, num_kv_heads=2, head_dim=8, dtype="float32", page_size=4, num_pages=10,
                                sliding_window=16, window_layers=(0, 1, 2, 4, 5), window_pages=7)
    assert (config.bytes_per_page, config.window_region_bytes) == (2 * 256, 7 * 5 * 2 * 256)
    core = core_config(config, layout.num_pages)
    assert (core.window_pages, core.window_tokens, core.window_prompt_ends) == (7, 16, False)
    kept = parse([*GEMMA_FLAGS, "--num-pages", "10", "--window-pages", "7", "--window-prompt-ends", "true"])
    assert core_config(kept, 10).window_prompt_ends is True
    assert parse([*GEMMA_FLAGS, "--num-pages", "10", "--window-pages", "7"], {"KVCACHE_WINDOW_PROMPT_ENDS": "true"}
                 ).window_prompt_ends is True
    # --pool-bytes is both regions: the window region first, the rest in pages of the full layer's rows
    sized = parse([*GEMMA_FLAGS, "--pool-bytes", str(7 * 5 * 2 * 256 + 12 * 2 * 256 + 100), "--window-pages", "7"])
    assert sized.resolved_num_pages == 12 and sized.layout().size_bytes == 7 * 5 * 2 * 256 + 12 * 2 * 256
    assert parse(["--num-pages", "10"], {"KVCACHE_SLIDING_WINDOW": "16", "KVCACHE_WINDOW_PAGES": "5"}
                 ).layout().window_pages == 5
    every = parse(["--sliding-window", "16", "--num-pages", "10", "--window-pages", "4"])  # Mistral: pages cost 0
    assert (every.bytes_per_page, every.layout().shape[0], every.layout().window_shape[0]) == (0, 0, 2)
    # a tier stores and loads such a pool's pages by group (docs/design.md §8): its namespace says so
    tiered = parse([*GEMMA_FLAGS, "--num-pages", "10", "--window-pages", "4", "--tier", "disk", "--tier-dir", "/t"])
    namespace = tier_namespace(tiered, tiered.layout())
    assert namespace is not None and namespace.window_apart
    plain = parse([*GEMMA_FLAGS, "--num-pages", "10", "--tier", "disk", "--tier-dir", "/t"])
    one_region = tier_namespace(plain, plain.layout())
    assert one_region is not None and not one_region.window_apart
    assert one_region.root("") != namespace.root("")  # the two layouts never share tier keys


def test_without_window_pages_nothing_changes() -> None:
    config = parse([*GEMMA_FLAGS, "--num-pages", "10"])
    assert config.window_pages == 0 and config.layout().window_pages == 0
    assert config.bytes_per_page == 6 * 2 * 256  # every layer of every page, as before
    core = core_config(config, 10)
    assert (core.window_pages, core.window_tokens) == (0, 0)


@pytest.mark.parametrize(("argv", "message"), [
    (["--num-pages", "10", "--window-pages", "4"],
     "--window-pages: 4 needs --sliding-window (the window layers whose rows the window pages hold), got "
     "--sliding-window 0"),
    ([*GEMMA_FLAGS, "--num-pages", "10", "--window-pages", "1"],
     "--window-pages: must be 0 or >= 2 (window page 0 is reserved), got 1"),
    ([*GEMMA_FLAGS, "--num-pages", "10", "--window-pages", "-3"], "--window-pages: must be >= 0, got -3"),
    ([*GEMMA_FLAGS, "--num-pages", "10", "--window-pages", "11"],
     "--window-pages: 11 is more than the pool's 10 pages (--num-pages): a page holds at most one window page"),
    ([*GEMMA_FLAGS, "--pool-bytes", "9000", "--window-pages", "7"],
     "--pool-bytes: 8.8 KiB holds fewer than 2 pages of 512 B beside the window region (17.5 KiB for "
     "--window-pages 7)"),
    (["--sliding-window", "16", "--pool-bytes", "1Mi", "--window-pages", "4"],
     "--window-pages: with every layer windowed the pages hold no rows, so --pool-bytes cannot size them: set "
     "--num-pages"),
    ([*GEMMA_FLAGS, "--num-pages", "10", "--window-prompt-ends", "true"],
     "--window-prompt-ends: needs --window-pages (the window rows it keeps are the window pages'), got "
     "--window-pages 0"),
])
def test_window_pages_that_cannot_make_a_pool_are_refused_naming_both_sides(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse(argv)
    assert str(err.value) == message
