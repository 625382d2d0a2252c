"""The reference model's paged path against its dense path, on a local pool (no server).

Pages are handed out here the way the service would: shuffled, never page 0. Pools start filled with NaN,
so any read of a slot nobody wrote poisons the logits, and any stray write shows up as a finite value.
"""

from __future__ import annotations

import math
import random
from itertools import pairwise

import pytest
import torch

from engine_client.reference import ModelConfig, ReferenceModel, check_pool_layout

CONFIG = ModelConfig()
PAGE_SIZES = [1, 4, 16]
NUM_PAGES = 64
ATOL = 1e-4


@pytest.fixture(scope="module")
def model() -> ReferenceModel:
    return ReferenceModel(CONFIG)


def make_pool(page_size: int, config: ModelConfig = CONFIG, num_pages: int = NUM_PAGES) -> torch.Tensor:
    return torch.full(config.pool_shape(num_pages, page_size), float("nan"), dtype=config.dtype)


def make_tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def as_table(pages: list[int]) -> torch.Tensor:
    return torch.tensor(pages, dtype=torch.int32)


class PageHandout:
    """Page ids 1..num_pages-1 in a seeded shuffled order, like a service whose free list has churned."""

    def __init__(self, num_pages: int = NUM_PAGES, seed: int = 0) -> None:
        self._free = list(range(1, num_pages))
        random.Random(seed).shuffle(self._free)

    def take(self, n: int) -> list[int]:
        assert n <= len(self._free), "test pool too small"
        taken, self._free = self._free[:n], self._free[n:]
        return taken


class PagedSession:
    """What an engine keeps per session: the page table, and how many leading positions have K/V."""

    def __init__(self, model: ReferenceModel, pool: torch.Tensor, handout: PageHandout,
                 shared_pages: list[int] | None = None, cached_tokens: int = 0) -> None:
        self.model, self.pool, self.handout = model, pool, handout
        self.pages = list(shared_pages or [])
        self.kv_tokens = cached_tokens

    def run(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Compute K/V for `token_ids` at the next positions, growing the table only as far as needed."""
        context_tokens = self.kv_tokens + token_ids.numel()
        missing = math.ceil(context_tokens / self.pool.shape[3]) - len(self.pages)
        if missing > 0:
            self.pages += self.handout.take(missing)
        logits = self.model.forward_paged(token_ids, self.kv_tokens, self.pool, as_table(self.pages))
        self.kv_tokens = context_tokens
        return logits

    def greedy(self, new_tokens: torch.Tensor, max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
        """One turn: feed `new_tokens`, then decode; the last sampled token is left without K/V."""
        logits = self.run(new_tokens)[-1]
        out, steps = [int(torch.argmax(logits))], [logits]
        while len(out) < max_new_tokens:
            logits = self.run(torch.tensor(out[-1:]))[-1]
            out.append(int(torch.argmax(logits)))
            steps.append(logits)
        return out, torch.stack(steps)


def slots_of(pages: list[int], num_tokens: int, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(page id, slot) of each position in [0, num_tokens), by the pool contract."""
    positions = torch.arange(num_tokens)
    return as_table(pages).long()[positions // page_size], positions % page_size


# ---------------------------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("chunks", [(37,), (5, 1, 13, 18), (16, 21), (1,) * 37],
                         ids=["prefill", "chunked", "page-aligned", "per-token"])
def test_paged_chunks_match_dense(model: ReferenceModel, page_size: int, chunks: tuple[int, ...]) -> None:
    tokens = make_tokens(sum(chunks))
    dense = model.forward_dense(tokens)
    session = PagedSession(model, make_pool(page_size), PageHandout())
    bounds = [0, *torch.tensor(chunks).cumsum(0).tolist()]
    paged = torch.cat([session.run(tokens[a:b]) for a, b in pairwise(bounds)])
    assert paged.shape == (37, CONFIG.vocab_size)
    torch.testing.assert_close(paged, dense, atol=ATOL, rtol=0)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_table_with_reserved_pages_matches_dense(model: ReferenceModel, page_size: int) -> None:
    tokens = make_tokens(30, seed=1)
    # The service reserves capacity ahead: entries past the context are ignored, even page 0 padding.
    pages = [*PageHandout().take(math.ceil(30 / page_size)), 0, 0]
    pool = make_pool(page_size)
    paged = torch.cat([model.forward_paged(tokens[:11], 0, pool, as_table(pages)),
                       model.forward_paged(tokens[11:], 11, pool, as_table(pages))])
    torch.testing.assert_close(paged, model.forward_dense(tokens), atol=ATOL, rtol=0)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_second_session_reuses_prefix_pages(model: ReferenceModel, page_size: int) -> None:
    shared_tokens = 32  # whole pages at every page size: the radix shares full pages only
    first_tokens = make_tokens(40, seed=2)
    second_tokens = torch.cat([first_tokens[:shared_tokens], make_tokens(15, seed=3)])
    pool, handout = make_pool(page_size), PageHandout()
    first = PagedSession(model, pool, handout)
    first.run(first_tokens)
    shared_pages = first.pages[: shared_tokens // page_size]
    shared_before = pool[:, :, shared_pages].clone()

    second = PagedSession(model, pool, handout, shared_pages=shared_pages, cached_tokens=shared_tokens)
    logits = second.run(second_tokens[shared_tokens:])

    torch.testing.assert_close(logits, model.forward_dense(second_tokens)[shared_tokens:], atol=ATOL, rtol=0)
    assert second.pages[: len(shared_pages)] == shared_pages
    assert not set(second.pages[len(shared_pages):]) & set(first.pages)
    assert torch.equal(pool[:, :, shared_pages], shared_before), "the second session wrote a shared page"
    # The first session is unaffected and carries on.
    more = make_tokens(6, seed=4)
    torch.testing.assert_close(first.run(more), model.forward_dense(torch.cat([first_tokens, more]))[40:],
                               atol=ATOL, rtol=0)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_greedy_paged_decode_matches_dense(model: ReferenceModel, page_size: int) -> None:
    prompt = make_tokens(20, seed=5)
    expected, expected_logits = model.greedy_generate_dense(prompt.tolist(), 24)
    session = PagedSession(model, make_pool(page_size), PageHandout())
    tokens, logits = session.greedy(prompt, 24)
    assert tokens == expected
    torch.testing.assert_close(logits, expected_logits, atol=ATOL, rtol=0)
    assert session.kv_tokens == 20 + 24 - 1


def test_multi_turn_conversation_matches_dense(model: ReferenceModel) -> None:
    """Streaming-session turns: turn N+1 starts at cached_tokens = context - 1 (the last sampled token)."""
    session = PagedSession(model, make_pool(4), PageHandout())
    history: list[int] = []
    for turn, (user_len, reply_len) in enumerate([(17, 6), (9, 5), (1, 7), (12, 4)]):
        user = make_tokens(user_len, seed=10 + turn).tolist()
        # The previous reply's last token has no K/V yet, so it is fed again ahead of the new input.
        new = history[session.kv_tokens:] + user
        assert len(new) == len(user) + (1 if history else 0)
        expected, _ = model.greedy_generate_dense(history + user, reply_len)
        reply, _ = session.greedy(torch.tensor(new), reply_len)
        assert reply == expected, f"turn {turn}"
        history += user + reply
        assert session.kv_tokens == len(history) - 1


def test_greedy_dense_golden_tokens(model: ReferenceModel) -> None:
    """Pins the seed-0 weights: every process and every engine built on this reference sees these ids."""
    tokens, logits = model.greedy_generate_dense([1, 2, 3, 4, 5, 6, 7, 8], 24)
    assert tokens == [247, 75, 162, 108, 77, 129, 216, 241, 15, 179, 62, 32,
                      420, 388, 256, 417, 408, 399, 337, 228, 59, 101, 68, 471]
    assert logits.shape == (24, CONFIG.vocab_size)
    assert torch.argmax(logits, dim=-1).tolist() == tokens


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 1), (8, 2)], ids=["mha", "mqa", "gqa4"])
def test_head_grouping_matches_dense(num_heads: int, num_kv_heads: int) -> None:
    config = ModelConfig(num_heads=num_heads, num_kv_heads=num_kv_heads, seed=7)
    model = ReferenceModel(config)
    tokens = make_tokens(29, seed=6)
    session = PagedSession(model, make_pool(4, config), PageHandout())
    paged = torch.cat([session.run(tokens[:10]), session.run(tokens[10:])])
    torch.testing.assert_close(paged, model.forward_dense(tokens), atol=ATOL, rtol=0)


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float16, 2e-2), (torch.bfloat16, 5e-2)])
def test_half_precision_paged_matches_dense(dtype: torch.dtype, atol: float) -> None:
    config = ModelConfig(dtype=dtype)
    model = ReferenceModel(config)
    tokens = make_tokens(40, seed=8)
    session = PagedSession(model, make_pool(4, config), PageHandout())
    paged = torch.cat([session.run(tokens[:23]), session.run(tokens[23:])])
    assert paged.dtype == dtype
    torch.testing.assert_close(paged.float(), model.forward_dense(tokens).float(), atol=atol, rtol=0)


# ---------------------------------------------------------------------------------------------- pool writes


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("start_pos", [0, 13])
def test_writes_land_only_in_new_slots(model: ReferenceModel, page_size: int, start_pos: int) -> None:
    num_tokens = 37
    tokens = make_tokens(num_tokens, seed=9)
    pages = PageHandout().take(math.ceil(num_tokens / page_size) + 2)  # two reserved, unused pages
    pool = make_pool(page_size)
    page_ids, slots = slots_of(pages, num_tokens, page_size)
    # Positions before start_pos "were written by another engine": a marker this call must only read.
    pool[:, :, page_ids[:start_pos], slots[:start_pos]] = 0.25

    logits = model.forward_paged(tokens[start_pos:], start_pos, pool, as_table(pages))

    assert torch.isfinite(logits).all(), "read a slot outside [0, context)"
    written = torch.zeros(NUM_PAGES, page_size, dtype=torch.bool)
    written[page_ids, slots] = True
    assert torch.isnan(pool[:, :, ~written]).all(), "wrote outside the table's context slots"
    assert torch.isnan(pool[:, :, 0]).all(), "wrote the null page"
    assert (pool[:, :, page_ids[:start_pos], slots[:start_pos]] == 0.25).all(), "rewrote a cached position"
    new = pool[:, :, page_ids[start_pos:], slots[start_pos:]]  # [layers, 2, new, kv_heads, dim]
    assert torch.isfinite(new).all()

    # Same computation through a contiguous table (pages 1, 2, ...) puts bitwise the same K/V in order.
    plain = torch.zeros_like(pool)
    plain_pages = list(range(1, len(pages) + 1))
    plain_ids, plain_slots = slots_of(plain_pages, num_tokens, page_size)
    plain[:, :, plain_ids[:start_pos], plain_slots[:start_pos]] = 0.25
    plain_logits = model.forward_paged(tokens[start_pos:], start_pos, plain, as_table(plain_pages))
    assert torch.equal(plain_logits, logits)
    assert torch.equal(plain[:, :, plain_ids[start_pos:], plain_slots[start_pos:]], new)

    # Layer 0's V depends on the token alone, so it pins which position landed in which slot.
    weights = model.state_dict()
    x = weights["embed"][tokens[start_pos:]]
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + CONFIG.rms_norm_eps) * weights["layers.0.attn_norm"]
    v0 = (h @ weights["layers.0.wv"]).view(-1, CONFIG.num_kv_heads, CONFIG.head_dim)
    torch.testing.assert_close(new[0, 1], v0, atol=1e-6, rtol=0)


def test_writes_are_visible_through_another_view_of_the_storage(model: ReferenceModel) -> None:
    """The pool is written in place: an engine's mapping and the service's see the same bytes."""
    storage = torch.full((math.prod(CONFIG.pool_shape(NUM_PAGES, 4)),), float("nan"))
    pool, other = storage.view(CONFIG.pool_shape(NUM_PAGES, 4)), storage.view(CONFIG.pool_shape(NUM_PAGES, 4))
    model.forward_paged(make_tokens(5), 0, pool, as_table([9, 3]))
    assert torch.isfinite(other[:, :, 9]).all()
    assert torch.isfinite(other[:, :, 3, :1]).all()
    assert torch.isnan(other[:, :, 3, 1:]).all()


# ---------------------------------------------------------------------------------------------- layout checks

MODEL_LAYOUT = "(layers=2, kv_heads=2, head_dim=32, dtype=float32)"


@pytest.mark.parametrize(("num_layers", "num_kv_heads", "head_dim", "dtype", "pool_layout"), [
    (2, 4, 64, torch.float16, "(layers=2, kv_heads=4, head_dim=64, dtype=float16)"),
    (3, 2, 32, torch.float32, "(layers=3, kv_heads=2, head_dim=32, dtype=float32)"),
    (2, 2, 32, torch.bfloat16, "(layers=2, kv_heads=2, head_dim=32, dtype=bfloat16)"),
    (2, 2, 16, torch.float32, "(layers=2, kv_heads=2, head_dim=16, dtype=float32)"),
])
def test_mismatched_pool_layout_names_both(model: ReferenceModel, num_layers: int, num_kv_heads: int,
                                          head_dim: int, dtype: torch.dtype, pool_layout: str) -> None:
    message = f"pool layout {pool_layout} does not match the model {MODEL_LAYOUT}"
    pool = torch.zeros(num_layers, 2, 8, 4, num_kv_heads, head_dim, dtype=dtype)
    with pytest.raises(ValueError) as raised:
        model.forward_paged(make_tokens(3), 0, pool, as_table([1]))
    assert str(raised.value) == message
    assert not pool.any()
    with pytest.raises(ValueError) as raised:
        check_pool_layout(CONFIG, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                          dtype=str(dtype).removeprefix("torch."), page_size=4)
    assert str(raised.value) == message


def test_check_pool_layout_accepts_a_fitting_layout() -> None:
    layout = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 32}
    for page_size in PAGE_SIZES:
        check_pool_layout(CONFIG, **layout, dtype="float32", page_size=page_size)
    with pytest.raises(ValueError, match=r"^pool page_size must be >= 1, got 0$"):
        check_pool_layout(CONFIG, **layout, dtype="float32", page_size=0)


@pytest.mark.parametrize(("pool", "message"), [
    (torch.zeros(2, 8, 4, 2, 32), r"^pool must be \[num_layers, 2, num_pages, page_size, num_kv_heads, "
                                  r"head_dim\], got shape \(2, 8, 4, 2, 32\)$"),
    (torch.zeros(2, 3, 8, 4, 2, 32), r"got shape \(2, 3, 8, 4, 2, 32\)$"),
    (torch.zeros(2, 2, 1, 4, 2, 32), r"^pool must have >= 2 pages \(page 0 is the null page\), got 1$"),
    (torch.zeros(2, 2, 4, 8, 2, 32).transpose(2, 3), r"^pool must be contiguous"),
], ids=["rank", "kv-dim", "one-page", "non-contiguous"])
def test_malformed_pool_raises(model: ReferenceModel, pool: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        model.forward_paged(make_tokens(3), 0, pool, as_table([1]))


@pytest.mark.parametrize(("start_pos", "num_tokens", "pages", "message"), [
    (0, 37, [5, 6, 7, 8, 9, 10, 11, 12, 13],
     "page_table holds 9 pages but 37 context tokens need 10 at page_size 4"),
    (36, 1, list(range(1, 10)), "page_table holds 9 pages but 37 context tokens need 10 at page_size 4"),
    (0, 1, [], "page_table holds 0 pages but 1 context tokens need 1 at page_size 4"),
    (0, 5, [3, 0], "page_table entries must be in [1, 64) (page 0 is the null page), got min 0 max 3 "
                   "in its first 2"),
    (0, 5, [3, 64], "page_table entries must be in [1, 64) (page 0 is the null page), got min 3 max 64 "
                    "in its first 2"),
    (0, 5, [3, 3], "page_table repeats a page id in its first 2 entries"),
    (-1, 5, [3, 4], "start_pos must be >= 0, got -1"),
], ids=["short", "short-at-start-pos", "empty", "null-page", "out-of-range", "repeat", "negative-start"])
def test_bad_page_table_raises_before_writing(model: ReferenceModel, start_pos: int, num_tokens: int,
                                              pages: list[int], message: str) -> None:
    pool = torch.zeros(CONFIG.pool_shape(NUM_PAGES, 4))
    with pytest.raises(ValueError) as raised:
        model.forward_paged(make_tokens(num_tokens), start_pos, pool, as_table(pages))
    assert str(raised.value) == message
    assert not pool.any()


@pytest.mark.parametrize(("token_ids", "message"), [
    (torch.zeros(0, dtype=torch.long), r"^token_ids must be a non-empty 1-D tensor, got shape \(0,\)$"),
    (torch.zeros(2, 3, dtype=torch.long), r"^token_ids must be a non-empty 1-D tensor, got shape \(2, 3\)$"),
    (torch.zeros(3), r"^token_ids must be an integer tensor, got torch.float32$"),
    (torch.tensor([1, 512]), r"^token ids must be in \[0, 512\), got min 1 max 512$"),
    (torch.tensor([-1, 5]), r"^token ids must be in \[0, 512\), got min -1 max 5$"),
])
def test_bad_tokens_raise(model: ReferenceModel, token_ids: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        model.forward_dense(token_ids)
    with pytest.raises(ValueError, match=message):
        model.forward_paged(token_ids, 0, make_pool(4), as_table([1, 2]))


# ---------------------------------------------------------------------------------------------- weights


def test_same_seed_gives_identical_weights() -> None:
    first = ReferenceModel(ModelConfig(seed=3)).state_dict()
    second = ReferenceModel(ModelConfig(seed=3)).state_dict()
    assert list(first) == list(second)
    assert list(first)[:2] == ["embed", "layers.0.attn_norm"]
    assert list(first)[-2:] == ["final_norm", "lm_head"]
    assert len(first) == 2 + 9 * CONFIG.num_layers + 1
    for name, tensor in first.items():
        assert torch.equal(tensor, second[name]), name


def test_different_seed_gives_different_logits(model: ReferenceModel) -> None:
    tokens = make_tokens(16)
    other = ReferenceModel(ModelConfig(seed=1)).forward_dense(tokens)
    assert (other - model.forward_dense(tokens)).abs().max() > 0.5
    assert torch.equal(ReferenceModel(CONFIG).forward_dense(tokens), model.forward_dense(tokens))


def test_weights_follow_config_dtype_and_shapes() -> None:
    config = ModelConfig(vocab_size=100, num_layers=3, hidden_size=64, num_heads=6, num_kv_heads=3,
                         head_dim=16, intermediate_size=96, dtype=torch.bfloat16)
    weights = ReferenceModel(config).state_dict()
    assert {tensor.dtype for tensor in weights.values()} == {torch.bfloat16}
    assert weights["embed"].shape == (100, 64)
    assert weights["layers.2.wq"].shape == (64, 96)
    assert weights["layers.2.wk"].shape == (64, 48)
    assert weights["layers.2.w_down"].shape == (96, 64)
    assert weights["lm_head"].shape == (64, 100)
    assert config.pool_shape(10, 16) == (3, 2, 10, 16, 3, 16)


@pytest.mark.parametrize(("fields", "message"), [
    ({"num_heads": 6, "num_kv_heads": 4},
     r"^ModelConfig.num_heads \(6\) must be a multiple of num_kv_heads \(4\) for grouped-query attention$"),
    ({"head_dim": 31}, r"^ModelConfig.head_dim must be even for rotary embeddings, got 31$"),
    ({"num_layers": 0}, r"^ModelConfig.num_layers must be >= 1, got 0$"),
])
def test_invalid_config_raises(fields: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig(**fields)


# ---------------------------------------------------------------------------------------------- sliding window

WINDOW = 8


@pytest.fixture(scope="module", params=[(0,), (0, 1)], ids=["window-layer-0", "window-every-layer"])
def window_model(request: pytest.FixtureRequest) -> ReferenceModel:
    return ReferenceModel(ModelConfig(sliding_window=WINDOW, window_layers=request.param))


def test_a_window_changes_only_the_positions_past_it(window_model: ReferenceModel, model: ReferenceModel) -> None:
    tokens = make_tokens(30, seed=20)
    windowed, full = window_model.forward_dense(tokens), model.forward_dense(tokens)  # same seed, same weights
    torch.testing.assert_close(windowed[:WINDOW], full[:WINDOW], atol=ATOL, rtol=0)
    assert (windowed[WINDOW:] - full[WINDOW:]).abs().amax(dim=-1).min() > 1e-3  # every later row differs


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("chunks", [(37,), (5, 1, 13, 18), (1,) * 37], ids=["prefill", "chunked", "per-token"])
def test_window_paged_chunks_match_dense(window_model: ReferenceModel, page_size: int,
                                         chunks: tuple[int, ...]) -> None:
    tokens = make_tokens(sum(chunks), seed=21)
    session = PagedSession(window_model, make_pool(page_size), PageHandout())
    bounds = [0, *torch.tensor(chunks).cumsum(0).tolist()]
    paged = torch.cat([session.run(tokens[a:b]) for a, b in pairwise(bounds)])
    torch.testing.assert_close(paged, window_model.forward_dense(tokens), atol=ATOL, rtol=0)


def test_window_layers_read_only_their_window() -> None:
    """With every layer windowed, K/V before the window may be anything: NaN there changes nothing."""
    model = ReferenceModel(ModelConfig(sliding_window=WINDOW, window_layers=(0, 1)))
    tokens = make_tokens(40, seed=22)
    pool = make_pool(4)
    session = PagedSession(model, pool, PageHandout())
    session.run(tokens[:30])
    page, slot = slots_of(session.pages, 30 - WINDOW + 1, 4)  # positions the next query at 30 cannot see
    pool[:, :, page, slot] = float("nan")
    torch.testing.assert_close(session.run(tokens[30:]), model.forward_dense(tokens)[30:], atol=ATOL, rtol=0)


def test_window_batch_matches_dense(window_model: ReferenceModel) -> None:
    pool, handout = make_pool(4), PageHandout()
    long, short = make_tokens(29, seed=23), make_tokens(11, seed=24)
    a, b = PagedSession(window_model, pool, handout), PagedSession(window_model, pool, handout)
    a.run(long[:20])
    b.pages = handout.take(3)
    out = window_model.forward_batch([(long[20:], 20, as_table(a.pages + handout.take(3))),
                                      (short, 0, as_table(b.pages))], pool)
    torch.testing.assert_close(out[0], window_model.forward_dense(long)[20:], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[1], window_model.forward_dense(short), atol=ATOL, rtol=0)


@pytest.mark.parametrize(("fields", "message"), [
    ({"sliding_window": 8}, r"^ModelConfig.sliding_window and window_layers go together \(a window and the layers "
                            r"that attend within it\), got sliding_window=8 window_layers=\(\)$"),
    ({"window_layers": (0,)}, r"^ModelConfig.sliding_window and window_layers go together .* got sliding_window=0 "
                              r"window_layers=\(0,\)$"),
    ({"sliding_window": -1}, r"^ModelConfig.sliding_window must be >= 0, got -1$"),
    ({"sliding_window": 8, "window_layers": (1, 0)},
     r"^ModelConfig.window_layers must be ascending, unique layers of 0-1, got \(1, 0\)$"),
    ({"sliding_window": 8, "window_layers": (2,)},
     r"^ModelConfig.window_layers must be ascending, unique layers of 0-1, got \(2,\)$"),
])
def test_invalid_window_config_raises(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig(**fields)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- MLA

MLA = ModelConfig(num_kv_heads=1, head_dim=32, kv_lora_rank=48, qk_rope_head_dim=16)
"""One latent of 48 + 16 = 64 values per token and layer: 32 in the K plane, 32 in the V plane."""


@pytest.fixture(scope="module")
def mla_model() -> ReferenceModel:
    return ReferenceModel(MLA)


def test_an_mla_models_pool_holds_one_latent_per_token_in_halves(mla_model: ReferenceModel) -> None:
    assert (MLA.attention, MLA.kv_dim, MLA.pool_shape(8, 4)) == ("mla", 64, (2, 2, 8, 4, 1, 32))
    tokens = make_tokens(10, seed=30)
    pool = make_pool(4, MLA)
    pages = PageHandout().take(3)
    mla_model.forward_paged(tokens, 0, pool, as_table(pages))
    # The latent of layer 0 as the model computes it: its halves are the K and V planes of the token's slot.
    _, latent, _ = mla_model._qkv(mla_model.layers[0], mla_model.embed[tokens], torch.arange(10))
    page, slot = slots_of(pages, 10, 4)
    assert torch.equal(pool[0, 0, page, slot, 0], latent[:, :32]) and torch.equal(pool[0, 1, page, slot, 0],
                                                                                latent[:, 32:])
    assert torch.isnan(pool[:, :, [p for p in range(NUM_PAGES) if p not in pages]]).all()  # nothing else written


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("chunks", [(37,), (5, 1, 13, 18), (1,) * 37], ids=["prefill", "chunked", "per-token"])
def test_mla_paged_chunks_match_dense(mla_model: ReferenceModel, page_size: int, chunks: tuple[int, ...]) -> None:
    tokens = make_tokens(sum(chunks), seed=31)
    session = PagedSession(mla_model, make_pool(page_size, MLA), PageHandout())
    bounds = [0, *torch.tensor(chunks).cumsum(0).tolist()]
    paged = torch.cat([session.run(tokens[a:b]) for a, b in pairwise(bounds)])
    torch.testing.assert_close(paged, mla_model.forward_dense(tokens), atol=ATOL, rtol=0)


def test_mla_second_session_reuses_prefix_pages_and_batches_match_dense(mla_model: ReferenceModel) -> None:
    pool, handout = make_pool(4, MLA), PageHandout()
    first_tokens = make_tokens(24, seed=32)
    first = PagedSession(mla_model, pool, handout)
    first.run(first_tokens)
    second_tokens = torch.cat([first_tokens[:20], make_tokens(9, seed=33)])
    second = PagedSession(mla_model, pool, handout, shared_pages=first.pages[:5], cached_tokens=20)
    torch.testing.assert_close(second.run(second_tokens[20:]), mla_model.forward_dense(second_tokens)[20:],
                               atol=ATOL, rtol=0)
    more, other = make_tokens(5, seed=34), make_tokens(7, seed=35)
    out = mla_model.forward_batch([(more, 24, as_table(first.pages + handout.take(2))),
                                   (other, 0, as_table(handout.take(2)))], pool)
    torch.testing.assert_close(out[0], mla_model.forward_dense(torch.cat([first_tokens, more]))[24:], atol=ATOL,
                               rtol=0)
    torch.testing.assert_close(out[1], mla_model.forward_dense(other), atol=ATOL, rtol=0)


def test_an_mla_model_refuses_a_full_attention_pool_of_other_sizes(mla_model: ReferenceModel) -> None:
    # A bare tensor does not say its kind: the MLA model reads its two planes of 32 as a latent of 64.
    with pytest.raises(ValueError, match=r"^pool layout \(layers=2, kv_heads=2, head_dim=64, dtype=float32\) does "
                                         r"not match the model \(layers=2, kv_heads=1, head_dim=64, dtype=float32\)$"):
        mla_model.forward_paged(make_tokens(3), 0, make_pool(4), as_table([1]))


@pytest.mark.parametrize(("fields", "message"), [
    ({"qk_rope_head_dim": 0}, r"^ModelConfig with MLA needs kv_lora_rank > 0 and an even qk_rope_head_dim in "
                              r"\[2, head_dim=32\), got kv_lora_rank=48 qk_rope_head_dim=0$"),
    ({"qk_rope_head_dim": 32}, r"qk_rope_head_dim in \[2, head_dim=32\), got kv_lora_rank=48 qk_rope_head_dim=32$"),
    ({"kv_lora_rank": 47}, r"^ModelConfig with MLA needs an even latent \(its halves go in the K and V planes\), "
                           r"got kv_lora_rank \+ qk_rope_head_dim = 63$"),
    ({"num_kv_heads": 2}, r"^ModelConfig with MLA has one latent per token: num_kv_heads must be 1, got 2$"),
    ({"sliding_window": 8, "window_layers": (0,)},
     r"^ModelConfig cannot have MLA and a sliding window \(a pool holds one or the other\)$"),
])
def test_invalid_mla_config_raises(fields: dict[str, object], message: str) -> None:
    mla = {"num_kv_heads": 1, "head_dim": 32, "kv_lora_rank": 48, "qk_rope_head_dim": 16}
    with pytest.raises(ValueError, match=message):
        ModelConfig(**(mla | fields))  # type: ignore[arg-type]


# ------------------------------------------------------------------------ window rows kept apart (window pages)

class WindowPagedSession:
    """A session on a pool that keeps window rows apart: pages hold the full layers' rows, window pages the window
    layers'. After each chunk the window pages of pages wholly before the next query's window are dropped (their
    table entry 0, the window page filled with NaN and handed out again), as the service drops window rows no
    later read needs."""

    def __init__(self, model: ReferenceModel, page_size: int, num_pages: int = NUM_PAGES) -> None:
        c = model.config
        full = c.num_layers - len(c.window_layers)
        shape = c.pool_shape(num_pages, page_size)
        self.model, self.page_size = model, page_size
        self.pool = torch.full((full, *shape[1:]), float("nan"), dtype=c.dtype)
        self.window = torch.full((len(c.window_layers), *shape[1:]), float("nan"), dtype=c.dtype)
        self.handout, self.window_handout = PageHandout(num_pages, seed=1), PageHandout(num_pages, seed=2)
        self.pages: list[int] = []
        self.windows: list[int] = []
        self.done = 0
        self.dropped = 0

    def run(self, tokens: torch.Tensor) -> torch.Tensor:
        end = self.done + tokens.numel()
        while len(self.pages) * self.page_size < end:
            self.pages += self.handout.take(1)
            self.windows += self.window_handout.take(1)
        out = self.model.forward_paged(tokens, self.done, self.pool, as_table(self.pages), window_pool=self.window,
                                       window_table=as_table(self.windows))
        self.done = end
        first_needed = max(end - self.model.config.sliding_window + 1, 0) // self.page_size
        for i in range(first_needed):
            if self.windows[i]:
                self.window[:, :, self.windows[i]] = float("nan")
                self.window_handout._free.append(self.windows[i])
                self.windows[i] = 0
                self.dropped += 1
        return out


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("chunks", [(37,), (5, 1, 13, 18), (1,) * 37], ids=["prefill", "chunked", "per-token"])
def test_window_pages_paged_chunks_match_dense_with_the_rows_before_the_window_dropped(
        window_model: ReferenceModel, page_size: int, chunks: tuple[int, ...]) -> None:
    tokens = make_tokens(sum(chunks), seed=21)
    session = WindowPagedSession(window_model, page_size)
    bounds = [0, *torch.tensor(chunks).cumsum(0).tolist()]
    paged = torch.cat([session.run(tokens[a:b]) for a, b in pairwise(bounds)])
    torch.testing.assert_close(paged, window_model.forward_dense(tokens), atol=ATOL, rtol=0)
    assert session.dropped > 0 and not session.window[:, :, 0].isfinite().any()  # window page 0 never written
    assert not session.pool[:, :, 0].isfinite().any()


def test_window_pages_and_one_region_give_the_same_logits(window_model: ReferenceModel) -> None:
    tokens = make_tokens(30, seed=25)
    one = PagedSession(window_model, make_pool(4), PageHandout())
    apart = WindowPagedSession(window_model, 4)
    for a, b in ((0, 12), (12, 13), (13, 30)):
        torch.testing.assert_close(apart.run(tokens[a:b]), one.run(tokens[a:b]), atol=0, rtol=0)


def window_parts(page_size: int = 4) -> tuple[ReferenceModel, torch.Tensor, torch.Tensor]:
    model = ReferenceModel(ModelConfig(sliding_window=WINDOW, window_layers=(0,)))
    shape = model.config.pool_shape(8, page_size)
    return model, torch.zeros((1, *shape[1:])), torch.zeros((1, *shape[1:]))


@pytest.mark.parametrize(("call", "message"), [
    (lambda m, p, w: m.forward_paged(make_tokens(4), 0, p, as_table([1]), window_pool=w),
     r"^window_pool and window_table go together \(a pool that keeps window rows apart\), got window_pool set and "
     r"window_table None$"),
    (lambda m, p, w: m.forward_paged(make_tokens(4), 0, torch.cat([p, p]), as_table([1]), window_pool=w,
                                     window_table=as_table([1])),
     r"^the pool holds 2 full and 1 window layers, the model has 1 full and 1 window layers$"),
    (lambda m, p, w: m.forward_paged(make_tokens(4), 8, p, as_table([1, 2, 3]), window_pool=w,
                                     window_table=as_table([0, 0, 3])),
     r"^window_table entries of pages 0-2 \(the window of positions \[1, 12\)\) must be in \[1, 8\), got min 0 max "
     r"3: window page 0 means the service dropped those rows$"),
    (lambda m, p, w: m.forward_paged(make_tokens(4), 0, p, as_table([1]), window_pool=w, window_table=as_table([])),
     r"^window_table holds 0 pages but 4 context tokens need 1 at page_size 4$"),
    (lambda m, p, w: ReferenceModel(ModelConfig()).forward_paged(make_tokens(4), 0, p, as_table([1]), window_pool=w,
                                                                 window_table=as_table([1])),
     r"^a window pool \(window_pool\) holds the rows of window layers, and this model has no sliding window$"),
])
def test_bad_window_pools_and_tables_are_refused_naming_both_sides(call: object, message: str) -> None:
    model, pool, window = window_parts()
    before = (pool.clone(), window.clone())
    with pytest.raises(ValueError, match=message):
        call(model, pool, window)  # type: ignore[operator]
    assert torch.equal(pool, before[0]) and torch.equal(window, before[1])  # nothing written


def test_window_pages_batch_matches_dense(window_model: ReferenceModel) -> None:
    long, short = make_tokens(29, seed=23), make_tokens(11, seed=24)
    a = WindowPagedSession(window_model, 4)
    a.run(long[:20])  # 20 positions, then the window pages before the next query's window are dropped
    b = WindowPagedSession(window_model, 4)
    b.pool, b.window = a.pool, a.window  # one pool: b's pages and window pages from the ones a has not taken
    b.handout._free = [p for p in a.handout._free if p not in a.pages]
    b.window_handout._free = [w for w in a.window_handout._free if w not in a.windows]
    a_pages, a_windows = a.pages + a.handout.take(3), a.windows + a.window_handout.take(3)
    b.window_handout._free = [w for w in b.window_handout._free if w not in a_windows]
    b.handout._free = [p for p in b.handout._free if p not in a_pages]
    b_pages, b_windows = b.handout.take(3), b.window_handout.take(3)
    out = window_model.forward_batch([(long[20:], 20, as_table(a_pages)), (short, 0, as_table(b_pages))], a.pool,
                                     window_pool=a.window, window_tables=[as_table(a_windows), as_table(b_windows)])
    torch.testing.assert_close(out[0], window_model.forward_dense(long)[20:], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[1], window_model.forward_dense(short), atol=ATOL, rtol=0)
    assert a.windows[:2] == [0, 0]  # positions 0-7: dropped before the batch, never read by it
    with pytest.raises(ValueError, match=r"^two sequences of the batch write the same window slot"):
        window_model.forward_batch([(short, 0, as_table(b_pages)), (short, 0, as_table(a_pages[-3:]))], a.pool,
                                   window_pool=a.window, window_tables=[as_table(b_windows), as_table(b_windows)])
