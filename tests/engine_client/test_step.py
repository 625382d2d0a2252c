"""`StepBatch` and `client.step` without a server: the request a batch becomes, and how its outcomes fill."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from engine_client import AsyncKVCacheClient, ClientOptions, KVCacheClient, PoolExhausted, SessionBusy
from engine_client.step import StepBatch
from engine_client.types import AppendResult, CloseResult, CommitResult, ExtendResult, OpenedSession
from protos.kvcache.v1 import kvcache_pb2 as pb

TOKENS = b"\x01\x00\x00\x00\x02\x00\x00\x00"


def error_status(code: int, reason: str, message: str) -> status_pb2.Status:
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.ErrorInfo(reason=reason, domain="kvcache.v1", metadata={"session_id": "s"}))
    return status_pb2.Status(code=code, message=message, details=[detail])


class FakeSession:
    """A session object: the batch sends its epoch and hands it each successful result."""

    def __init__(self, session_id: str, epoch: int) -> None:
        self.session_id = session_id
        self.epoch = epoch
        self.applied: list[tuple[str, Any]] = []

    def _apply(self, kind: str, result: Any) -> None:
        self.applied.append((kind, result))


def fill_every_kind(batch: StepBatch) -> FakeSession:
    s = FakeSession("s", 7)
    batch.open("new", streaming=False, timeout_seconds=0.0, cache_salt="t")
    batch.append(s, [1, 2], reserve_tokens=4)
    batch.extend("other", 8)
    batch.commit(s, np.array([1, 2], dtype=np.int64), kv_tokens=3, turn=2)
    batch.abort("other")
    batch.close(s, cache=True)
    batch.match([1, 2], "t")
    return s


def test_a_batch_becomes_one_step_request_of_columns_in_order() -> None:
    batch = StepBatch()
    s = fill_every_kind(batch)
    request = batch.request("eng-1")
    assert request.engine_id == "eng-1" and not request.ops

    def u32(*values: int) -> bytes:
        return np.array(values, dtype="<u4").tobytes()

    assert request.columns == pb.StepColumns(
        kinds=bytes([1, 2, 3, 4, 4, 5, 6]), session_ids=["new", "s", "other", "s", "other", "s", ""],
        epochs=np.array([0, 7, 0, 7, 0, 7, 0], dtype="<u8").tobytes(),
        counts=np.array([0, 4, 8, 3, 0, 0, 0], dtype="<i4").tobytes(),
        flags=bytes([pb.STEP_FLAG_TIMEOUT, 0, 0, pb.STEP_FLAG_KV_TOKENS, pb.STEP_FLAG_SET, pb.STEP_FLAG_SET, 0]),
        token_counts=u32(0, 2, 0, 2, 0, 0, 2), token_ids=TOKENS * 3, turns=u32(0, 0, 0, 2, 0, 0, 0),
        timeouts=np.zeros(7, dtype="<f8").tobytes(), cache_salts=["t", "", "", "", "", "", "t"],
    )
    with pytest.raises(RuntimeError, match="sent already"):
        batch.request("eng-1")
    with pytest.raises(RuntimeError, match="sent already"):
        batch.append(s, [1])


def test_a_batch_becomes_one_step_request_in_order() -> None:
    batch = StepBatch(columns=False)  # one StepOp message per op
    s = FakeSession("s", 7)
    batch.open("new", streaming=False, timeout_seconds=0.0, cache_salt="t")
    batch.append(s, [1, 2], reserve_tokens=4)
    batch.extend("other", 8)
    batch.commit(s, np.array([1, 2], dtype=np.int64), kv_tokens=3, turn=2)
    batch.abort("other")
    batch.close(s, cache=True)
    batch.match([1, 2], "t")
    request = batch.request("eng-1")
    assert request == pb.StepRequest(engine_id="eng-1", ops=[
        pb.StepOp(open=pb.OpenSessionRequest(session_id="new", streaming=False, timeout_seconds=0.0,
                                             cache_salt="t")),
        pb.StepOp(append=pb.AppendSessionRequest(session_id="s", packed_token_ids=TOKENS, reserve_tokens=4,
                                                 epoch=7, packed_response=True)),
        pb.StepOp(extend=pb.ExtendSessionRequest(session_id="other", reserve_tokens=8, packed_response=True)),
        pb.StepOp(commit=pb.CommitSessionRequest(session_id="s", packed_token_ids=TOKENS, kv_tokens=3, turn=2,
                                                 epoch=7)),
        pb.StepOp(commit=pb.CommitSessionRequest(session_id="other", abort=True)),
        pb.StepOp(close=pb.CloseSessionRequest(session_id="s", cache=True, epoch=7)),
        pb.StepOp(match=pb.MatchPrefixRequest(packed_token_ids=TOKENS, cache_salt="t", packed_response=True)),
    ])
    with pytest.raises(RuntimeError, match="sent already"):
        batch.request("eng-1")
    with pytest.raises(RuntimeError, match="sent already"):
        batch.append(s, [1])


def test_an_open_without_an_id_draws_one_so_later_ops_can_name_it() -> None:
    batch = StepBatch(engine_id="")
    batch.open()
    request = batch.request("ignored")  # the batch's own engine id ("": no owner) wins over the client's
    assert len(request.columns.session_ids[0]) == 32 and request.engine_id == ""


def test_outcomes_fill_from_the_response_and_failures_stay_typed_values() -> None:
    batch = StepBatch()
    s = FakeSession("s", 7)
    appended = batch.append(s, [1, 2], 4)
    extended = batch.extend(s, 4)
    busy = batch.append("t", [3])
    assert not appended.done and "pending" in repr(appended)
    with pytest.raises(RuntimeError, match="has not been sent"):
        _ = appended.value
    batch.request("e")
    response = pb.StepResponse(results=[
        pb.StepResult(append=pb.AppendSessionResponse(session_id="s", epoch=7, turn=1, context_tokens=2,
                                                      capacity_tokens=8, packed_page_ids=b"\x03\x00\x00\x00",
                                                      num_pages=1)),
        pb.StepResult(status=error_status(code_pb2.RESOURCE_EXHAUSTED, "POOL_EXHAUSTED", "no room")),
        pb.StepResult(status=error_status(code_pb2.FAILED_PRECONDITION, "SESSION_BUSY", "busy")),
    ])
    outcomes = batch.apply(response)
    assert outcomes == [appended, extended, busy]
    assert appended.ok and isinstance(appended.value, AppendResult)
    assert (appended.value.capacity_tokens, appended.value.page_ids.tolist()) == (8, [3])
    assert isinstance(extended.error, PoolExhausted) and not extended.ok and extended.done
    assert (extended.error.reason, extended.error.message, extended.error.metadata) == (
        "POOL_EXHAUSTED", "no room", {"session_id": "s"})
    with pytest.raises(PoolExhausted):
        _ = extended.value
    assert isinstance(busy.error, SessionBusy)
    assert s.applied == [("append", appended.value)]  # only successes reach the session


def test_a_response_with_the_wrong_number_of_results_is_refused() -> None:
    batch = StepBatch()
    batch.close("s")
    batch.request("e")
    with pytest.raises(RuntimeError, match="answered 0 results for 1 ops"):
        batch.apply(pb.StepResponse())


class StepStub:
    def __init__(self, response: pb.StepResponse, asynchronous: bool) -> None:
        self.response = response
        self.asynchronous = asynchronous
        self.sent: list[Any] = []

    def Step(self, request: Any, **kwargs: Any) -> Any:
        self.sent.append((request, kwargs["metadata"]))
        if not self.asynchronous:
            return self.response

        async def answer() -> Any:
            return self.response

        return answer()


RESPONSE = pb.StepResponse(results=[
    pb.StepResult(open=pb.OpenSessionResponse(session_id="s", epoch=1, instance_id="i9")),
    pb.StepResult(extend=pb.ExtendSessionResponse(session_id="s", epoch=1, turn=1, capacity_tokens=12,
                                                  page_offset=2, page_ids=[5], num_pages=3)),
])


def _sync(batch: StepBatch) -> tuple[list[Any], Any, str]:
    with KVCacheClient("127.0.0.1:1", ClientOptions(auth_token="k"), engine_id="eng-1") as client:
        client._stub = stub = StepStub(RESPONSE, asynchronous=False)  # type: ignore[assignment]
        outcomes = client.step(batch)
        return outcomes, stub.sent, client.instance_id


def _async(batch: StepBatch) -> tuple[list[Any], Any, str]:
    async def run() -> tuple[list[Any], Any, str]:
        client = AsyncKVCacheClient("127.0.0.1:1", ClientOptions(auth_token="k"), engine_id="eng-1")
        try:
            client._stub = stub = StepStub(RESPONSE, asynchronous=True)  # type: ignore[assignment]
            outcomes = await client.step(batch)
            return outcomes, stub.sent, client.instance_id
        finally:
            await client.close()

    return asyncio.run(run())


@pytest.mark.parametrize("run", [_sync, _async], ids=["sync", "asyncio"])
def test_both_clients_send_the_batch_as_one_step(run: Callable[[StepBatch], tuple[list[Any], Any, str]]) -> None:
    batch = StepBatch()
    opened = batch.open("s")
    extended = batch.extend("s", 4)
    outcomes, sent, instance_id = run(batch)
    [(request, metadata)] = sent
    assert request.engine_id == "eng-1" and request.columns.kinds == bytes([1, 3])  # open, extend
    assert metadata == (("authorization", "Bearer k"),)  # no instance known yet: nothing pinned
    assert outcomes == [opened, extended]
    assert opened.value.epoch == 1 and instance_id == "i9"  # the open taught the client the instance
    assert extended.value == ExtendResult("s", 1, 1, 12, 2, extended.value.page_ids, 3)
    assert extended.value.page_ids.tolist() == [5]


def test_outcomes_fill_from_column_results_and_failures_stay_typed_values() -> None:
    batch = StepBatch()
    s = FakeSession("s", 7)
    opened = batch.open("s")
    appended = batch.append(s, [1, 2], 4)
    extended = batch.extend(s, 4)
    busy = batch.append("t", [3])
    committed = batch.commit(s, [9])
    closed = batch.close(s, cache=True)
    matched = batch.match([1, 2, 3, 4])
    batch.request("e")

    def col(*values: int, dtype: str = "<u4") -> bytes:
        return np.array(values, dtype=dtype).tobytes()

    response = pb.StepResponse(columns=pb.StepColumnResults(
        codes=col(0, 0, 0, code_pb2.FAILED_PRECONDITION, 0, 0, 0, dtype="<i4"),
        errors=[error_status(code_pb2.FAILED_PRECONDITION, "SESSION_BUSY", "busy")],
        epochs=col(7, 7, 7, 0, 0, 0, 0, dtype="<u8"), turns=col(0, 1, 1, 0, 0, 0, 0),
        cached_tokens=col(0, 0, 0, 0, 0, 4, 4), context_tokens=col(0, 2, 0, 0, 3, 0, 0),
        capacity_tokens=col(0, 8, 12, 0, 0, 0, 0), page_offsets=col(0, 0, 2, 0, 0, 0, 0),
        num_pages=col(0, 2, 3, 0, 1, 0, 0), prefix_hit_tokens=col(0, 0, 0, 0, 0, 0, 0),
        kv_tokens=col(0, 0, 0, 0, 2, 0, 0), closed=bytes([0, 0, 0, 0, 0, 1, 0]),
        page_counts=col(0, 2, 1, 0, 0, 0, 1), page_ids=col(3, 4, 5, 3, dtype="<i4"), opened_ids=["s"],
        timeouts=np.array([600.0, 0, 0, 0, 0, 0, 0], dtype="<f8").tobytes(), instance_id="i9"))
    outcomes = batch.apply(response)
    assert outcomes == [opened, appended, extended, busy, committed, closed, matched]
    assert opened.value == OpenedSession("s", 7, 600.0, "i9")
    assert appended.value == AppendResult("s", 7, 1, 0, 2, 8, 0, appended.value.page_ids, 2, 0)
    assert appended.value.page_ids.tolist() == [3, 4] and extended.value.page_ids.tolist() == [5]
    assert (extended.value.capacity_tokens, extended.value.page_offset, extended.value.num_pages) == (12, 2, 3)
    assert not busy.ok and busy.done and isinstance(busy.error, SessionBusy)
    assert (busy.error.reason, busy.error.message, busy.error.metadata) == ("SESSION_BUSY", "busy", {"session_id": "s"})
    with pytest.raises(SessionBusy):
        _ = busy.value
    assert committed.value == CommitResult("s", 3, 2, 1, False)
    assert closed.value == CloseResult("s", True, 4)
    assert matched.value.cached_tokens == 4 and matched.value.page_ids.tolist() == [3]
    # The session objects got their results in order, as the unary calls would have handed them.
    assert [kind for kind, _ in s.applied] == ["append", "extend", "commit", "close"]


def test_column_results_of_the_wrong_size_are_refused() -> None:
    batch = StepBatch()
    batch.close("s")
    batch.request("e")
    with pytest.raises(RuntimeError, match="answered 0 results for 1 ops"):
        batch.apply(pb.StepResponse(columns=pb.StepColumnResults(instance_id="i")))
