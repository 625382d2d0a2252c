"""Tier keys: the SHA-256 chain of docs/design.md §8, pinned to exact digests (a change here orphans every value
ever stored, so it must be deliberate)."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest

from cache_service.core.tier_keys import KEY_BYTES, Namespace, chain, key_from_text, key_text, page_key

LLAMA = Namespace(model_name="llama-3-8b", num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16",
                  page_size=16)


def test_the_namespace_encoding_is_versioned_and_length_prefixed() -> None:
    assert LLAMA.encode() == (b"kvcache-tier-v1" + b"\x0a\0\0\0llama-3-8b" + b"\x02\0\0\x0032" + b"\x01\0\0\x008"
                              + b"\x03\0\0\x00128" + b"\x08\0\0\0bfloat16" + b"\x02\0\0\x0016")


def test_a_kind_other_than_full_attention_is_a_last_field() -> None:
    mla = Namespace("dsv3", 61, 1, 576, "bfloat16", 16, "mla")
    assert mla.encode() == Namespace("dsv3", 61, 1, 576, "bfloat16", 16).encode() + b"\x03\0\0\0mla"
    assert Namespace("dsv3", 61, 1, 576, "bfloat16", 16, "full").encode() == Namespace(
        "dsv3", 61, 1, 576, "bfloat16", 16).encode()  # full-attention keys are what they were before kinds


def test_a_window_is_three_more_fields_naming_it_and_its_layers() -> None:
    gemma = Namespace("gemma3", 6, 4, 256, "bfloat16", 16, "full", 1024, (0, 1, 2, 3, 4))
    assert gemma.encode() == Namespace("gemma3", 6, 4, 256, "bfloat16", 16).encode() + (
        b"\x0e\0\0\0sliding_window" + b"\x04\0\0\x001024" + b"\x09\0\0\x000,1,2,3,4")
    others = {gemma.root(""), Namespace("gemma3", 6, 4, 256, "bfloat16", 16, "full", 512, (0, 1, 2, 3, 4)).root(""),
              Namespace("gemma3", 6, 4, 256, "bfloat16", 16, "full", 1024, (0, 1, 2, 3)).root(""),
              Namespace("gemma3", 6, 4, 256, "bfloat16", 16).root("")}
    assert len(others) == 4  # another window, other window layers or none: pages are never shared


def test_window_rows_kept_apart_are_one_more_field() -> None:
    one_region = Namespace("gemma3", 6, 4, 256, "bfloat16", 16, "full", 1024, (0, 1, 2, 3, 4))
    apart = Namespace("gemma3", 6, 4, 256, "bfloat16", 16, "full", 1024, (0, 1, 2, 3, 4), window_apart=True)
    assert apart.encode() == one_region.encode() + b"\x0c\0\0\0window_apart"
    assert apart.root("") != one_region.root("")  # the values' chunks are in another order: never shared


def test_roots_are_pinned() -> None:
    assert LLAMA.root("").hex() == "3fd25ad78fc8aecb4eca11c92e46917dd5b5f6d81b830d5473e8c04d65fda4a3"
    assert LLAMA.root("tenant-a").hex() == "396d19788b8627c67e4dd03acffdc1c9ad348f77062656fde95f5cb81d22fa1e"
    default = Namespace("default", 2, 4, 64, "float16", 16)  # the service's default flags
    assert default.root("").hex() == "4f61dcf17c6b586d91081013bb5d77ec1ede3adac008a1408b9e3d4db34b8923"


def test_the_root_is_sha256_of_namespace_and_salt() -> None:
    salt = b"tenant-a"
    assert LLAMA.root("tenant-a") == hashlib.sha256(LLAMA.encode() + struct.pack("<I", len(salt)) + salt).digest()


def test_the_chain_is_pinned_and_ignores_a_partial_page() -> None:
    keys = chain(LLAMA.root(""), np.arange(40, dtype=np.int32), 16)
    assert [k.hex() for k in keys] == ["8efb1d9c72799aa6a5cc8f9cf38580480d96be77d5f2f41d5684ab03fb39bc01",
                                       "97d2cc178386023414f703dba9674af50b8baca9d13b79aa501b52e34c60d13d"]


def test_each_key_is_sha256_of_parent_and_int32_le_tokens() -> None:
    root = LLAMA.root("")
    tokens = np.array([7, -1 & 0x7FFFFFFF, 0, 123456] * 8, dtype=np.int32)
    first = hashlib.sha256(root + tokens[:16].astype("<i4").tobytes()).digest()
    second = hashlib.sha256(first + tokens[16:].astype("<i4").tobytes()).digest()
    assert chain(root, tokens, 16) == [first, second]
    assert page_key(root, tokens[:16]) == first
    assert page_key(first, tokens[16:].astype("<i4").tobytes()) == second
    assert chain(root, tokens.astype("<i4").tobytes(), 16) == [first, second]  # bytes in, same keys


def test_a_big_endian_array_gives_the_same_keys() -> None:
    tokens = np.arange(32, dtype=">i4")
    assert chain(LLAMA.root(""), tokens, 16) == chain(LLAMA.root(""), tokens.astype(np.int32), 16)


@pytest.mark.parametrize("other", [
    Namespace("llama-3-70b", 32, 8, 128, "bfloat16", 16),
    Namespace("llama-3-8b", 31, 8, 128, "bfloat16", 16),
    Namespace("llama-3-8b", 32, 4, 128, "bfloat16", 16),
    Namespace("llama-3-8b", 32, 8, 64, "bfloat16", 16),
    Namespace("llama-3-8b", 32, 8, 128, "float16", 16),
    Namespace("llama-3-8b", 32, 8, 128, "bfloat16", 32),
    Namespace("llama-3-8b3", 2, 8, 128, "bfloat16", 16),  # no ambiguity between adjacent fields
    Namespace("llama-3-8b", 32, 8, 128, "bfloat16", 16, "mla"),  # another attention kind
])
def test_any_namespace_field_changes_the_root(other: Namespace) -> None:
    assert other.root("") != LLAMA.root("")


def test_salts_and_prefixes_separate_keys() -> None:
    tokens = np.arange(16, dtype=np.int32)
    assert chain(LLAMA.root("a"), tokens, 16) != chain(LLAMA.root("b"), tokens, 16)
    # a page's key depends on everything before it
    a = chain(LLAMA.root(""), np.r_[np.zeros(16, np.int32), tokens], 16)
    b = chain(LLAMA.root(""), np.r_[np.ones(16, np.int32), tokens], 16)
    assert a[1] != b[1]


def test_key_text_round_trips_and_rejects_foreign_names() -> None:
    key = LLAMA.root("")
    assert key_text(key) == "kvc1-" + key.hex()
    assert key_from_text(key_text(key)) == key
    for bad in ("kvc1-zz" + "0" * 62, "kvc2-" + key.hex(), "kvc1-" + key.hex()[:-2], "", "kvc1-"):
        assert key_from_text(bad) is None


def test_a_parent_must_be_a_whole_key() -> None:
    with pytest.raises(ValueError, match=f"a parent key has {KEY_BYTES} bytes, got 3"):
        chain(b"abc", np.arange(16, dtype=np.int32), 16)
    with pytest.raises(ValueError, match="got 0"):
        page_key(b"", np.arange(16, dtype=np.int32))
