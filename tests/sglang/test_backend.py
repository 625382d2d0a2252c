"""SGLang 0.5.23 on kvcache (`--radix-cache-backend kvcache`, docs/design.md §14), against SGLang alone in the
same run: greedy tokens, prefix hits across processes and with vLLM both ways, streaming sessions, a SIGKILLed
process's session adopted by another, kvcache killed and restarted under a running SGLang.

Three engines, started once together: `alone` (SGLang without kvcache), `a` and `b` (two SGLang processes
on one kvcache). The tests run in file order and share them; the last two kill `a`, then kvcache. Every
engine runs SGLang's strict idle check (a mismatch of `available + evictable + protected + session_held +
uncached == total` stops its scheduler, and the next request fails).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from engine_client import KVCacheClient
from engine_client.vllm.driver import save_model
from tests.integration.conftest import ServerProcess, verify_stats
from tests.loopback import wait_until
from tests.sglang.conftest import LAYOUT, PAGE, SglangEngine

pytestmark = [pytest.mark.xdist_group("vllm-c"), pytest.mark.timeout(1800)]

RNG = np.random.default_rng(7)


def tokens(n: int) -> list[int]:
    return [int(t) for t in RNG.integers(1, 500, n)]


P1, P2 = tokens(69), tokens(45)
GEN = 8


def aligned(n: int) -> int:
    return n // PAGE * PAGE


@dataclass
class Rig:
    server: ServerProcess
    alone: SglangEngine
    a: SglangEngine
    b: SglangEngine
    logs: Path

    def client(self) -> KVCacheClient:
        return KVCacheClient(self.server.target)


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    tmp = tmp_path_factory.mktemp("sglang")
    model = save_model("llama", tmp / "llama")
    server = ServerProcess(*LAYOUT, "--num-pages", "512", log_path=tmp / "kvcache.log")
    specs = {"alone": {}, "a": {"kvcache": server.target, "engine_id": "sglang-a"},
             "b": {"kvcache": server.target, "engine_id": "sglang-b"}}
    engines: dict[str, SglangEngine] = {}

    def start(name: str) -> None:
        engines[name] = SglangEngine(model, tmp / f"{name}.log", **specs[name])  # type: ignore[arg-type]

    rig: Rig | None = None
    try:
        with ThreadPoolExecutor(3) as pool:
            for future in [pool.submit(start, name) for name in specs]:
                future.result()
        rig = Rig(server, engines["alone"], engines["a"], engines["b"], tmp)
        yield rig
    finally:
        for engine in engines.values():
            if engine.proc.poll() is None:
                engine.close()
        server = rig.server if rig is not None else server  # a test may have restarted it
        if server.proc.poll() is None:
            verify_stats(server.target)
            code, _ = server.terminate()
            assert code == 0, server.log_tail()
        server.close()


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
        info = client.get_session(session_id)
        seen.append(info.context_tokens)
        return seen[-1] == num_tokens and info.state != "IN_TURN"

    try:
        wait_until(done, f"{session_id} commits {num_tokens} tokens")
    except AssertionError as e:
        raise AssertionError(f"{e} (it has {seen[-1]})") from None


def test_greedy_tokens_equal_sglang_alone_computed_and_loaded(rig: Rig) -> None:
    alone = gen(rig.alone, P1, P2)
    computed = gen(rig.a, P1, P2)
    assert [o["tokens"] for o in computed] == [o["tokens"] for o in alone]
    assert [o["num_cached_tokens"] for o in computed] == [0, 0]
    rig.a.flush_cache()  # SGLang's own tree is empty: whatever hits now came from kvcache
    loaded = gen(rig.a, P1, P2)
    assert [o["tokens"] for o in loaded] == [o["tokens"] for o in alone]
    # Saved: prompt + output but the last token, whole pages; asked: the prompt but its last token.
    assert [o["num_cached_tokens"] for o in loaded] == [aligned(len(P1) - 1), aligned(len(P2) - 1)]


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


def test_a_sigkilled_processes_session_is_adopted_with_its_history(rig: Rig) -> None:
    rig.a.open_session("chat-2")
    history: list[int] = []
    for turn in range(2):
        new = tokens(40 if turn == 0 else 12)
        [out] = gen(rig.a, new, session="chat-2")
        history += new + out["tokens"]
    with rig.client() as c:
        committed(c, "chat-2", len(history) - 1)
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


def test_kvcache_killed_and_restarted_under_a_running_sglang(rig: Rig) -> None:
    address = rig.server.address
    rig.server.kill()
    p5 = tokens(60)
    [ref] = gen(rig.alone, p5)
    [out] = gen(rig.b, p5)  # kvcache is down: SGLang computes
    assert (out["tokens"], out["num_cached_tokens"]) == (ref["tokens"], 0)
    rig.server.close()
    rig.server = ServerProcess(*LAYOUT, "--num-pages", "512", listen=address,
                               log_path=rig.logs / "kvcache-restarted.log")
    p6 = tokens(60)

    def saved_again() -> bool:
        gen(rig.b, p6)
        with rig.client() as c:
            return c.match_prefix(p6).cached_tokens > 0

    wait_until(saved_again, "b reconnects to the restarted kvcache and saves again", timeout=120, poll=0.5)
    rig.b.flush_cache()
    [out] = gen(rig.b, p6)
    assert out["num_cached_tokens"] == aligned(len(p6) - 1)
    log = rig.b.log_text()
    assert log.count("unreachable (") == 1 and log.count("is back after") == 1, rig.b.log_tail()
    # Every engine still serves: SGLang's strict idle check passed throughout.
    [again] = gen(rig.alone, p6)
    assert again["tokens"] == out["tokens"]
