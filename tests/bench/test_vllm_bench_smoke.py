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


def test_vllm_bench_conversations_need_window(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        vllm_bench.main(["--conversations", "2"])
    assert e.value.code == 2
    assert "--conversations N takes --window and N > 0" in capsys.readouterr().err
