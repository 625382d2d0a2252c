"""SGLang 0.5.23 on kvcache (`--radix-cache-backend kvcache`, docs/design.md §14), against SGLang alone in the
same run: greedy tokens, prefix hits across processes and with vLLM both ways, streaming sessions, a SIGKILLed
process's session adopted by another, bad session requests, a parked session that expired, kvcache down at
SGLang's start and killed and restarted under a running SGLang, Steps over the step lane (§10).

Three engines, started once together: `alone` (SGLang without kvcache), `a` and `b` (two SGLang processes
on one kvcache). kvcache starts only once they are up (so both start with it down) and announces a step
lane. The tests run in file order and share them; the last ones kill `a`, then kvcache. Every engine runs
SGLang's strict idle check (a mismatch of `available + evictable + protected + session_held + uncached ==
total` stops its scheduler, and the next request fails).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine_client import KVCacheClient
from engine_client.errors import SessionNotFound
from engine_client.vllm.driver import save_model
from tests.integration.conftest import ServerProcess, verify_stats
from tests.loopback import free_port, wait_until
from tests.sglang.conftest import LAYOUT, PAGE, SglangEngine

pytestmark = [pytest.mark.xdist_group("vllm-c"), pytest.mark.timeout(1800)]

RNG = np.random.default_rng(7)


def tokens(n: int) -> list[int]:
    return [int(t) for t in RNG.integers(1, 500, n)]


P1, P2 = tokens(69), tokens(45)
GEN = 8
PARKED_TIMEOUT = 30
"""kvcache's --parked-session-timeout: a parked session is adopted well within it, or expires in the test that
waits for it."""


def aligned(n: int) -> int:
    return n // PAGE * PAGE


@dataclass
class Rig:
    server: ServerProcess
    alone: SglangEngine
    a: SglangEngine
    b: SglangEngine
    logs: Path
    notes: dict[str, Any] = field(default_factory=dict)
    """What one test leaves for a later one (the tests run in file order)."""

    def client(self) -> KVCacheClient:
        return KVCacheClient(self.server.target)


def serve(tmp: Path, address: str, log: str) -> ServerProcess:
    return ServerProcess(*LAYOUT, "--num-pages", "512", "--step-socket", str(tmp / "step.sock"),
                         "--parked-session-timeout", str(PARKED_TIMEOUT), listen=address, log_path=tmp / log)


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    tmp = tmp_path_factory.mktemp("sglang")
    model = save_model("llama", tmp / "llama")
    address = f"127.0.0.1:{free_port()}"  # kvcache comes up there once the engines are up
    specs = {"alone": {}, "a": {"kvcache": address, "engine_id": "sglang-a"},
             "b": {"kvcache": address, "engine_id": "sglang-b"}}
    engines: dict[str, SglangEngine] = {}

    def start(name: str) -> None:
        engines[name] = SglangEngine(model, tmp / f"{name}.log", **specs[name])  # type: ignore[arg-type]

    rig: Rig | None = None
    try:
        with ThreadPoolExecutor(3) as pool:
            for future in [pool.submit(start, name) for name in specs]:
                future.result()
        rig = Rig(serve(tmp, address, "kvcache.log"), engines["alone"], engines["a"], engines["b"], tmp)
        yield rig
    finally:
        for engine in engines.values():
            if engine.proc.poll() is None:
                engine.close()
        if rig is not None:  # the server the tests left (the last one restarts it)
            if rig.server.proc.poll() is None:
                verify_stats(rig.server.target)
                code, _ = rig.server.terminate()
                assert code == 0, rig.server.log_tail()
            rig.server.close()


@pytest.fixture(autouse=True)
def invariant(rig: Rig) -> Iterator[None]:
    yield
    if rig.server.proc.poll() is None:
        # A request's answer reaches the test before its scheduler step's closing Step (the flush runs after
        # SGLang has sent the step's outputs): wait for that Step, then no session may be left in a turn.
        with rig.client() as c:
            wait_until(lambda: not [s for s in c.list_sessions() if s.state == "IN_TURN"],
                       "every save committed and every lookup turn rolled back")
        verify_stats(rig.server.target)


def gen(engine: SglangEngine, *prompts: list[int], session: str = "") -> list[dict]:  # type: ignore[type-arg]
    return engine.generate([{"prompt": p, "max_tokens": GEN, **({"session_id": session} if session else {})}
                            for p in prompts])


def committed(client: KVCacheClient, session_id: str, num_tokens: int) -> None:
    """Wait until kvcache's session has committed `num_tokens` (the engine's save of a turn runs in the scheduler
    step after the one that answered it); any other final count fails the wait with the count seen."""
    seen: list[int] = []

    def done() -> bool:  # and the turn ended: its tokens may be appended before its commit arrives
        try:
            info = client.get_session(session_id)
        except SessionNotFound:  # a streaming session is opened in kvcache with its first save: a step later
            seen.append(-1)
            return False
        seen.append(info.context_tokens)
        return seen[-1] == num_tokens and info.state != "IN_TURN"

    try:
        wait_until(done, f"{session_id} commits {num_tokens} tokens")
    except AssertionError as e:
        raise AssertionError(f"{e} (it has {seen[-1]})") from None


def lane_peers(server: ServerProcess) -> set[int]:
    """The pids that opened the service's step lane (its `step_lane_connected` log lines)."""
    assert server.log_path is not None
    lines = [json.loads(line) for line in server.log_path.read_text().splitlines() if "step_lane_connected" in line]
    return {int(e["peer_pid"]) for e in lines if e.get("event") == "step_lane_connected"}


def test_sglang_started_while_kvcache_was_down_connects_over_the_step_lane(rig: Rig) -> None:
    """`a` and `b` started before kvcache was up: each warned once and served; its first request connects, and
    its scheduler's Steps take the step lane the service announces (docs/design.md §10)."""
    p = tokens(40)
    [ref] = gen(rig.alone, p)
    for engine in (rig.a, rig.b):
        [out] = gen(engine, p)
        assert out["tokens"] == ref["tokens"]
        log = engine.log_text()
        assert log.count("unreachable (") == 1 and log.count("is back after") == 1, engine.log_tail()
    schedulers = set(rig.a.children()) | set(rig.b.children())
    wait_until(lambda: len(lane_peers(rig.server) & schedulers) == 2, "a's and b's schedulers on the step lane")


def test_greedy_tokens_equal_sglang_alone_computed_and_loaded(rig: Rig) -> None:
    alone = gen(rig.alone, P1, P2)
    before = reuse_of(rig, "sglang-a")
    computed = gen(rig.a, P1, P2)
    assert [o["tokens"] for o in computed] == [o["tokens"] for o in alone]
    assert [o["num_cached_tokens"] for o in computed] == [0, 0]
    # Saved: prompt + output but the last token, whole pages; each save reports where its KV came from.
    saved = aligned(len(P1) + GEN - 1) + aligned(len(P2) + GEN - 1)
    assert reported(rig, "sglang-a", before, 2) == (0, 0, saved)  # (SGLang's own, loaded, computed)
    rig.a.flush_cache()  # SGLang's own tree is empty: whatever hits now came from kvcache
    before = reuse_of(rig, "sglang-a")
    loaded = gen(rig.a, P1, P2)
    assert [o["tokens"] for o in loaded] == [o["tokens"] for o in alone]
    # Asked: the prompt but its last token.
    hits = [aligned(len(P1) - 1), aligned(len(P2) - 1)]
    assert [o["num_cached_tokens"] for o in loaded] == hits
    assert reported(rig, "sglang-a", before, 2) == (0, sum(hits), saved - sum(hits))


def reuse_of(rig: Rig, engine_id: str) -> tuple[int, int, int, int]:
    """kvcache's reuse figures for one engine: (turns, engine_cached, loaded, computed)."""
    with rig.client() as c:
        for e in c.get_stats().engine_reuse:
            if e.engine_id == engine_id:
                return e.turns, e.engine_cached_tokens, e.loaded_tokens, e.computed_tokens
    return 0, 0, 0, 0


def reported(rig: Rig, engine_id: str, before: tuple[int, int, int, int], turns: int) -> tuple[int, int, int]:
    """Once `turns` more commits reported, what they said: (engine_cached, loaded, computed) added since `before`
    (a finished request's save and its commit follow its answer by a scheduler step)."""
    wait_until(lambda: reuse_of(rig, engine_id)[0] - before[0] >= turns, f"{engine_id}'s {turns} reuse reports")
    now = reuse_of(rig, engine_id)
    assert now[0] - before[0] == turns, (now, before)
    return now[1] - before[1], now[2] - before[2], now[3] - before[3]


def test_a_second_sglang_process_hits_the_first_ones_prefix(rig: Rig) -> None:
    shared = P1[:50] + tokens(30)
    [alone1, alone2] = gen(rig.alone, P1, shared)
    [out1, out2] = gen(rig.b, P1, shared)
    assert (out1["tokens"], out2["tokens"]) == (alone1["tokens"], alone2["tokens"])
    assert (out1["num_cached_tokens"], out2["num_cached_tokens"]) == (aligned(len(P1) - 1), aligned(50))


def test_vllm_and_sglang_share_a_prefix_both_ways(rig: Rig) -> None:
    """One pool, two engines of one model and layout (docs/design.md §14): a prompt SGLang computed is a hit for
    vLLM, and one vLLM computed is a hit for SGLang, each with its engine's own tokens."""
    from tests.vllm.conftest import started_engines

    x, y = tokens(90), tokens(70)
    specs = {"alone": {}, "on-kvcache": {"kvcache": rig.server.target}}
    with started_engines(rig.logs / "llama", rig.logs, "vllm", specs) as vllm, rig.client() as c:
        gen(rig.b, x)  # SGLang computes x and saves it (prompt and answer but the last token)
        wait_until(lambda: c.match_prefix(x).cached_tokens == aligned(len(x)), "SGLang's save of x")
        [want_x] = vllm["alone"].generate([{"prompt": x, "max_tokens": GEN}])
        [got_x] = vllm["on-kvcache"].generate([{"prompt": x, "max_tokens": GEN}])
        assert got_x["tokens"] == want_x["tokens"]
        assert got_x["num_cached_tokens"] == aligned(len(x) - 1)  # loaded from what SGLang wrote

        vllm["on-kvcache"].generate([{"prompt": y, "max_tokens": GEN}])  # vLLM computes y, saves it at its finish
        wait_until(lambda: c.match_prefix(y).cached_tokens == aligned(len(y)), "vLLM's save of y")
        [want_y] = gen(rig.alone, y)
        [got_y] = gen(rig.a, y)
        assert got_y["tokens"] == want_y["tokens"]
        assert got_y["num_cached_tokens"] == aligned(len(y) - 1)  # loaded from what vLLM wrote


def test_a_streaming_session_computes_only_each_turns_new_tokens(rig: Rig) -> None:
    rig.a.open_session("chat-1")
    history: list[int] = []
    cached, prompts = [], []
    for turn in range(4):
        new = tokens(40 if turn == 0 else 12)
        [out] = gen(rig.a, new, session="chat-1")
        history += new
        cached.append(out["num_cached_tokens"])
        prompts.append(out["prompt_tokens"])
        last = out["tokens"]
        history += out["tokens"]
    # Each turn after the first reuses the whole history SGLang holds: all but its new tokens and the last
    # generated token of the turn before (whose KV was never computed).
    assert cached == [0] + [prompts[i] - 13 for i in range(1, 4)]
    with rig.client() as c:
        # kvcache's copy: every turn appended only its new tokens, committed up to SGLang's KV (the last turn's
        # save follows its answer by one scheduler step).
        committed(c, "chat-1", len(history) - 1)
        info = c.get_session("chat-1")
        assert (info.streaming, info.state, info.engine_id) == (True, "IDLE", "sglang-a")
        assert c.session_tokens("chat-1") == history[:-1]
    [ref] = gen(rig.alone, history[: -GEN] )
    assert ref["tokens"] == last
    rig.a.close_session("chat-1")
    with rig.client() as c:
        wait_until(lambda: "chat-1" not in [s.session_id for s in c.list_sessions()], "chat-1 closed in kvcache")


def sessions(client: KVCacheClient) -> list[tuple[str, str, int]]:
    return sorted((s.session_id, s.state, s.context_tokens) for s in client.list_sessions())


def refused(engine: SglangEngine, message: str, prompt: list[int], session: str, **params: Any) -> None:
    """SGLang refuses the session request with its own error (a 400: `Engine.generate` raises ValueError)."""
    with pytest.raises(AssertionError, match=re.escape(f"ValueError: {message}")):
        engine.generate([{"prompt": prompt, "max_tokens": GEN, "session_id": session, "session_params": params}])


def test_bad_session_requests_get_sglangs_own_error_and_leak_nothing(rig: Rig) -> None:
    """A session id SGLang does not know, turns of a streaming session that are not appends, a closed session:
    SGLang's own error, kvcache's sessions unchanged by each, the session's next good turn an append as before
    (the invariant fixture checks kvcache's pool after; SGLang's strict idle check would stop its scheduler)."""
    with rig.client() as c:  # no turn of an earlier test still committing: the end compares against this
        wait_until(lambda: all(state != "IN_TURN" for _, state, _ in sessions(c)), "no session in a turn")
        before = sessions(c)
    refused(rig.a, "Invalid request: session id nope does not exist", tokens(20), "nope")
    rig.a.open_session("chat-bad")
    history = tokens(40)
    [out] = gen(rig.a, history, session="chat-bad")
    history += out["tokens"]
    with rig.client() as c:
        committed(c, "chat-bad", len(history) - 1)
        held = sessions(c)
    for params, message in (({"replace": True}, "Streaming sessions do not support replace."),
                            ({"offset": 5}, "Streaming sessions do not support offset."),
                            ({"drop_previous_output": True},
                             "Streaming sessions do not support drop_previous_output.")):
        refused(rig.a, message, tokens(8), "chat-bad", **params)
        with rig.client() as c:
            assert sessions(c) == held, params
    new = tokens(12)
    [out] = gen(rig.a, new, session="chat-bad")
    assert out["num_cached_tokens"] == out["prompt_tokens"] - 13  # the bad turns left nothing behind
    history += new + out["tokens"]
    with rig.client() as c:
        committed(c, "chat-bad", len(history) - 1)
        assert c.session_tokens("chat-bad") == history[:-1]
    rig.a.close_session("chat-bad")
    refused(rig.a, "Invalid request: session id chat-bad does not exist", tokens(8), "chat-bad")
    with rig.client() as c:
        wait_until(lambda: sessions(c) == before, "chat-bad closed in kvcache, nothing else changed")
    [again] = gen(rig.a, P2)  # a's scheduler still runs: its strict idle check passed after every refusal
    assert again["num_cached_tokens"] == aligned(len(P2) - 1)


def test_a_sigkilled_processes_session_is_adopted_with_its_history(rig: Rig) -> None:
    rig.a.open_session("chat-2")
    rig.a.open_session("chat-3")  # left parked: the next test waits for it to expire
    history: list[int] = []
    for turn in range(2):
        new = tokens(40 if turn == 0 else 12)
        [out] = gen(rig.a, new, session="chat-2")
        history += new + out["tokens"]
    other = tokens(50)
    [out] = gen(rig.a, other, session="chat-3")
    rig.notes["chat-3"] = other + out["tokens"]
    with rig.client() as c:
        committed(c, "chat-2", len(history) - 1)
        committed(c, "chat-3", len(rig.notes["chat-3"]) - 1)
    rig.a.kill_all()
    with rig.client() as c:
        wait_until(lambda: c.get_session("chat-2").state == "PARKED", "chat-2 parked at a's lease end")
        held = c.get_session("chat-2").context_tokens
    assert aligned(held) == aligned(len(history) - 1)
    # A new SGLang process knows nothing of chat-2: the client opens it there and sends the whole history.
    rig.b.open_session("chat-2")
    new = tokens(10)
    [out] = gen(rig.b, history + new, session="chat-2")
    [ref] = gen(rig.alone, history + new)
    assert out["tokens"] == ref["tokens"]
    assert out["num_cached_tokens"] == aligned(held)
    with rig.client() as c:
        committed(c, "chat-2", len(history + new) + GEN - 1)
        info = c.get_session("chat-2")
        assert (info.state, info.engine_id, info.former_engine_id) == ("IDLE", "sglang-b", "sglang-a")
    rig.b.close_session("chat-2")


def test_a_parked_session_that_expired_starts_over_with_its_history_cached(rig: Rig) -> None:
    """chat-3 parked when `a` died and nobody adopted it within --parked-session-timeout: kvcache closed it with
    cache (docs/design.md §11). SGLang on `b` does not know it (its own error); opened there, its turn 1 with the
    whole history is a new kvcache session that hits the history through the radix."""
    history = rig.notes["chat-3"]
    with rig.client() as c:
        wait_until(lambda: "chat-3" not in [s.session_id for s in c.list_sessions()],
                   "chat-3 expires after --parked-session-timeout", timeout=PARKED_TIMEOUT + 60, poll=0.5)
        assert c.match_prefix(history).cached_tokens == aligned(len(history) - 1)
    refused(rig.b, "Invalid request: session id chat-3 does not exist", tokens(8), "chat-3")
    rig.b.open_session("chat-3")
    new = tokens(10)
    [out] = gen(rig.b, history + new, session="chat-3")
    [ref] = gen(rig.alone, history + new)
    assert out["tokens"] == ref["tokens"]
    assert out["num_cached_tokens"] == aligned(len(history) - 1)
    with rig.client() as c:
        committed(c, "chat-3", len(history + new) + GEN - 1)
        info = c.get_session("chat-3")
        assert (info.state, info.engine_id, info.former_engine_id) == ("IDLE", "sglang-b", "")
    rig.b.close_session("chat-3")
    with rig.client() as c:
        wait_until(lambda: "chat-3" not in [s.session_id for s in c.list_sessions()], "chat-3 closed in kvcache")


def test_the_benchmarks_workloads_on_a_real_engine(rig: Rig) -> None:
    """bench/sglang_bench.py's smoke on this module's engine (the benchmark itself starts four): its three
    modes' conversations, their per-turn prefill counts and the plot. The same conversations in every mode:
    a regular session's turn continues the request it names, as a plain request carrying the history does;
    a streaming turn computes only its new tokens and the last token generated before."""
    from bench import sglang_bench as bench

    runs = {mode: bench.chat(rig.b, mode, 1, 3, 12, 4, np.random.default_rng(3), "smoke") for mode in bench.MODES}
    prompts = {mode: [o["prompt_tokens"] for [o] in per_turn] for mode, per_turn in runs.items()}
    assert prompts["no_session"] == prompts["regular_session"] == prompts["streaming_session"] == [12, 28, 44]
    assert [bench.computed(outs) for outs in runs["streaming_session"]] == [12, 13, 13]
    assert [o["tokens"] for [o] in runs["regular_session"]] == [o["tokens"] for [o] in runs["no_session"]]
    mean_ms, last_ms, done = bench.summary(runs["streaming_session"])
    assert done == 38 and mean_ms > 0 and last_ms > 0
    bench.plot(str(rig.logs / "plot.png"), "smoke", {f"{m}, SGLang on kvcache": r for m, r in runs.items()})
    assert (rig.logs / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_kvcache_killed_and_restarted_under_a_running_sglang(rig: Rig) -> None:
    address = rig.server.address
    rig.server.kill()
    p5 = tokens(60)
    [ref] = gen(rig.alone, p5)
    [out] = gen(rig.b, p5)  # kvcache is down: SGLang computes
    assert (out["tokens"], out["num_cached_tokens"]) == (ref["tokens"], 0)
    rig.server.close()
    rig.server = serve(rig.logs, address, "kvcache-restarted.log")
    p6 = tokens(60)

    def saved_again() -> bool:
        gen(rig.b, p6)
        with rig.client() as c:
            return c.match_prefix(p6).cached_tokens > 0

    wait_until(saved_again, "b reconnects to the restarted kvcache and saves again", timeout=120, poll=0.5)
    rig.b.flush_cache()
    [out] = gen(rig.b, p6)
    assert out["num_cached_tokens"] == aligned(len(p6) - 1)
    log = rig.b.log_text()  # one warning per outage: at its start (the first test) and this one
    assert log.count("unreachable (") == 2 and log.count("is back after") == 2, rig.b.log_tail()
    wait_until(lambda: bool(set(rig.b.children()) & lane_peers(rig.server)), "b's scheduler on the new step lane")
    # Every engine still serves: SGLang's strict idle check passed throughout.
    [again] = gen(rig.alone, p6)
    assert again["tokens"] == out["tokens"]
