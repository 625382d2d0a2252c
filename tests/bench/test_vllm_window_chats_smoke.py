"""bench/vllm_window_chats.py (`vllm_bench --window --conversations N`) runs end to end with the real vLLM on the tiny
Gemma-3-style model, its counts exact (no timing is asserted)."""

from __future__ import annotations

import pytest

from bench import vllm_bench

# four engines of its own, two at a time: in the engine group beside the TP and MLA modules, the lightest of three
pytestmark = [pytest.mark.xdist_group("vllm-b"), pytest.mark.timeout(900)]


def test_vllm_bench_window_conversations_prints_both_pools(capsys: pytest.CaptureFixture[str]) -> None:
    # The tiny Gemma-3-style model (window 32: 2 window pages before a hit point), 3 conversations of 4 turns of 80 +
    # 16 tokens (24 pages each), on two pools of 36 whole pages' bytes: 36 whole pages, or 72 pages of the full
    # layer's rows and 28 window pages. Each request waits for the one before it to commit: the counts are exact.
    assert vllm_bench.main(["--window", "--conversations", "3", "--quick"]) == 0
    out = capsys.readouterr().out
    rows = {line[:28].strip(): line[28:].split() for line in out.splitlines() if line.startswith(("before:", "after:"))}
    before, after = rows["before: whole pages"], rows["after: window rows apart"]
    # B replays 12 prompts of 2,688 tokens in all; whole pages hold no conversation whole after A
    assert before[:6] == ["36", "-", "0/3", "-", "22.6%", "2,080"]
    assert before[8:] == ["0", "141"]
    # window rows apart hold two: 24 pages and the window rows before 4 turns' ends (8 window pages) = 1.00 MiB;
    # B's replays hit at the previous turn's end where held: 1,024 tokens
    assert after[:6] == ["72", "28", "2/3", "1.00", "38.1%", "1,664"]
    assert after[8:] == ["128", "106"]
    assert ("per conversation: every layer's rows 2.25 MiB; target (full rows + the window before each turn's end, "
            "x1.2) 1.20 MiB; after holds 1.00 MiB (0.44x of whole pages)") in out
    assert "[vllm_bench] tokens equal on both pools (engine A's and engine B's): yes" in out
    assert "[vllm_bench] after within the target: yes; kvcache's accounting invariant after the run: holds" in out
