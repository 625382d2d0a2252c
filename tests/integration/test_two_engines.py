"""Two separate engine processes share KV through the service (docs/design.md §2-3, issue 3's headline test)."""

from __future__ import annotations

import json

from engine_client import KVCacheClient

from .conftest import ServerProcess, run_engine


def test_engine_b_reads_byte_identical_kv_that_engine_a_wrote(any_server: ServerProcess) -> None:
    a = json.loads(run_engine("writer", "--target", any_server.target, "--tokens", "42", "--seed", "5"))
    assert (a["cached_tokens"], a["context_tokens"]) == (0, 42)
    assert len(a["pages"]) == 11  # 42 tokens, 4 per page
    b = json.loads(run_engine("reader", "--target", any_server.target, "--tokens", "42", "--seed", "5"))
    # A closed with cache=true: its 10 full pages (40 tokens) are in the radix; B hits all of them.
    assert (b["cached_tokens"], b["prefix_hit_tokens"]) == (40, 40)
    assert b["pages"][:10] == a["pages"][:10]
    assert b["identical"] is True
    with KVCacheClient(any_server.target) as client:
        st = client.get_stats(verify=True)
    assert (st.evictable_pages, st.in_flight_pages, st.session_held_pages) == (10, 0, 0)


def test_a_different_prefix_gets_no_hit_and_sees_no_foreign_kv(server: ServerProcess) -> None:
    run_engine("writer", "--target", server.target, "--tokens", "24", "--seed", "1")
    b = json.loads(run_engine("reader", "--target", server.target, "--tokens", "24", "--seed", "2"))
    assert (b["cached_tokens"], b["prefix_hit_tokens"]) == (0, 0)
