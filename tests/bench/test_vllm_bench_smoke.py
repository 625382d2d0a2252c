"""bench/vllm_bench.py runs end to end with the real vLLM on the tiny model (no timing is asserted)."""

from __future__ import annotations

import pytest

from bench import vllm_bench

pytestmark = [pytest.mark.xdist_group("vllm"), pytest.mark.timeout(900)]  # real vLLM engines start in ~20-60 s


def test_vllm_bench_quick_prints_its_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert vllm_bench.main(["--quick"]) == 0
    out = capsys.readouterr().out
    rows = {line[:44].strip(): line[44:].split() for line in out.splitlines()
            if line.startswith(("shared prefix", "chat:"))}
    rows.update({line[:44].strip(): line[44:].split() for line in out.splitlines() if line.startswith("one at a")})
    assert list(rows) == ["shared prefix: 4 docs x 64 tok, new engine", "chat: 2 chats x 3 turns, A,B,A, x3",
                          "one at a time: 8 new prompts x 16 tok"]
    assert rows["one at a time: 8 new prompts x 16 tok"][2] == str(8 * 16)  # nothing cached: every token computed
    shared = rows["shared prefix: 4 docs x 64 tok, new engine"]
    assert shared[:2] == ["-", "-"]  # --quick runs no vLLM-alone baseline
    assert int(shared[2]) == 4 * 32  # engine B computes each question; the documents (4 full pages) come from kvcache
    assert "new requests a step:" in out and " us a request on vLLM's scheduler thread" in out
    assert "worker side, one page = 32 KiB (2 layers, K+V)" in out
    assert "[vllm_bench] kvcache's accounting invariant after the run: holds" in out


def test_vllm_bench_copy_prints_the_copy_rows_without_engines(capsys: pytest.CaptureFixture[str]) -> None:
    assert vllm_bench.main(["--copy", "--quick", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert "worker side, one page = 32 KiB (2 layers, K+V)" in out
    assert "bound, same run: a contiguous copy of the same bytes" in out and "(target >= 50%)" in out
    assert "starting engines" not in out


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


def test_vllm_bench_conversations_need_window(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        vllm_bench.main(["--conversations", "2"])
    assert e.value.code == 2
    assert "--conversations N takes --window and N > 0" in capsys.readouterr().err
