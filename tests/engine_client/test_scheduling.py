"""`engine_client.scheduling`, the engine-neutral pieces the vLLM connector and the SGLang backend share: the
step's ops and their callbacks, session views and turns, transfer plans, one warning per outage. Pure: no
service (the connector's and the backend's tests run them against real services and engines)."""

from __future__ import annotations

import numpy as np
import pytest

from engine_client.scheduling.ops import StepOps
from engine_client.scheduling.outage import Outage
from engine_client.scheduling.plans import TransferPlan
from engine_client.scheduling.turns import SessionView, extends


@pytest.mark.parametrize(("history", "tokens", "strictly", "want"), [
    ([1, 2], [1, 2, 3], True, True),
    ([1, 2], [1, 2], True, False),
    ([1, 2], [1, 2], False, True),
    ([1, 2], [1, 3, 4], True, False),
    ([1, 2, 3], [1, 2], False, False),
    ([], [7], True, True),
    ([], [], True, False),
])
def test_a_turn_extends_its_history_only_as_a_prefix(history: list[int], tokens: list[int], strictly: bool,
                                                     want: bool) -> None:
    assert extends(np.asarray(history, np.int32), np.asarray(tokens, np.int32), strictly=strictly) is want


def test_a_session_view_grows_its_page_table_and_resets() -> None:
    view = SessionView("s", True, "salt", 3)
    view.apply(0, np.arange(10, 14, dtype=np.int32))
    view.apply(14, np.arange(100, 110, dtype=np.int32))  # past the first 16 entries: the table doubles
    assert (view.num_pages, view.pages.size) == (24, 32)
    assert view.page_range(16, 48, 16).tolist() == [11, 12]
    assert view.page_range(14 * 16, 14 * 16 + 1, 16).tolist() == [100]
    view.tokens = np.asarray([1, 2, 3], np.int32)
    view.reset()
    assert (view.num_pages, view.tokens.size, view.kv_tokens) == (0, 0, 0)


def test_a_transfer_plan_saves_what_is_computed_within_capacity_and_commits_the_confirmed_prefix() -> None:
    plan = TransferPlan()
    plan.opened(cached_tokens=32, capacity_tokens=96)
    assert (plan.kv_start, plan.planned_end, plan.confirmed_end, plan.capacity) == (32, 32, 32, 96)
    assert plan.save_span(computed=32, end=80, held=128) == (32, 80)
    assert plan.save_span(computed=32, end=200, held=64) == (32, 64)  # the engine's blocks end first
    plan.planned_end = 80
    assert plan.needs_room(80, 16) is False and plan.needs_room(81, 16) is True
    plan.confirm(40, 80)  # does not start within the confirmed prefix [0, 32)
    assert plan.confirmed_end == 32
    plan.confirm(32, 80)
    assert (plan.confirmed_end, plan.committable(70), plan.committable(10)) == (80, 70, 32)
    plan.load, plan.loaded, plan.planned_end = 16, 16, 96
    plan.preempted()
    assert (plan.load, plan.loaded, plan.planned_end) == (0, 0, 80)
    plan.saving = False
    assert plan.needs_room(200, 16) is False


def test_step_ops_deliver_every_outcome_in_order_and_an_unsent_step_fails_them_all() -> None:
    ops = StepOps()
    seen: list[tuple[str, str]] = []
    first = ops.batch.open("a", streaming=False)
    ops.on(first, lambda o: seen.append(("open", o.error.reason if o.error else "ok")))
    ops.batch.append("a", [1, 2, 3])  # an op without a callback
    second = ops.batch.close("a")
    ops.on(second, lambda o: seen.append(("close", str(o.error))))
    assert len(ops) == 3
    assert ops.send(lambda batch: None) is False
    assert len(ops) == 0 and ops.handlers == [] and ops.finishes == []
    assert seen == [("open", ""), ("close", "UNAVAILABLE: kvcache is unreachable (the batch was not sent)")]
    assert ops.send(lambda batch: None) is True  # nothing queued: nothing to send


def test_an_outage_warns_once_and_says_how_it_ended() -> None:
    now = [100.0]
    outage = Outage(lambda: now[0])
    assert outage.down() is True  # unreachable at the start: the first warning
    assert outage.down() is False
    now[0] = 103.5
    assert outage.came_up("i1") == (Outage.FIRST, 3.5)
    assert (outage.up, outage.ever_up, outage.down_since) == (True, True, None)
    now[0] = 110.0
    assert outage.down() is True and outage.down() is False
    now[0] = 112.0
    assert outage.came_up("i1") == (Outage.BACK, 2.0)
    assert outage.down() is True
    assert outage.came_up("i2") == (Outage.RESTARTED, 0.0)
    assert Outage().came_up("i9") == (Outage.FIRST, None)
