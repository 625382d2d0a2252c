"""bench/agent_pressure.py runs end to end on real vLLM engines (--quick, the small pool, three of its modes:
vLLM alone, sessions closed cached, agent trees; nothing timed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import agent_pressure

pytestmark = [pytest.mark.xdist_group("vllm"), pytest.mark.timeout(900)]  # three engines start together, ~45 s


def test_agent_pressure_quick_prints_its_table_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "agent_pressure.png"
    assert agent_pressure.main(["--quick", "--pools", "small", "--modes", "alone,cached,trees", "--starts-ahead", "3",
                                "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    for title in ("vLLM alone", "closed cached", "agent trees"):  # each mode ran its 22 requests
        assert f"[agent_pressure] {title} (small pool): 22 requests in " in out
    lines = out.splitlines()
    head = lines.index(next(line for line in lines if line.startswith("main-agent turn")))
    assert lines[head - 1] == "small pool: 32 pages of 16 (512 tokens)"
    assert lines[head].split() == ["main-agent", "turn", "prompt", "vLLM", "alone", "closed", "cached", "agent",
                                   "trees"]
    rows = {line[:22].strip(): [int(x) for x in line[22:].split()] for line in lines[head + 2 : head + 7]}
    assert list(rows) == ["M1", "M2", "M3", "subagents (19 turns)", "all prefill"]
    # main turns: prompt, then cached and computed for each mode; M1 finds nothing anywhere
    assert rows["M1"] == [256, 0, 256, 0, 256, 0, 256]
    for turn, prompt in (("M2", 292), ("M3", 328)):
        cached, computed = rows[turn][1::2], rows[turn][2::2]
        assert rows[turn][0] == prompt and [c + k for c, k in zip(cached, computed, strict=True)] == [prompt] * 3
    assert rows["subagents (19 turns)"][0] == 2080 and rows["all prefill"][0] == 2956
    # a streaming session keeps its partial last page and last answer: its subagents compute fewer tokens
    assert rows["subagents (19 turns)"][2] < rows["subagents (19 turns)"][1]
    # the agent tree keeps the waiting main agent: its M3 hits more than with subagents closed cached
    assert rows["M3"][5] > rows["M3"][3]
    usage = {line[:22].strip(): [float(x) for x in line[22:].split()] for line in lines
             if line.startswith(("closed cached ", "agent trees ")) and "closed child" not in line}
    assert list(usage) == ["closed cached", "agent trees"]
    assert all(len(u) == 9 and all(0 < x <= 1 for x in u) for u in usage.values())  # 8 marks and the peak
    relief = next(line for line in lines if line.startswith("agent trees ") and "closed child" in line).split()
    assert relief[2:] == ["closed", "child", relief[4], "ordinary", relief[6], "parent", relief[8], "demoted", "idle",
                          relief[11], "demoted", "parent", relief[14]]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "[agent_pressure] kvcache's accounting invariant after each run: holds" in out
    assert "[agent_pressure] same tokens in every mode: yes" in out
