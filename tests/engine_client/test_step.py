"""`StepBatch` and `client.step` without a server: the request a batch becomes, and how its outcomes fill."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from engine_client import AsyncKVCacheClient, ClientOptions, InvalidTokens, KVCacheClient, PoolExhausted, SessionBusy
from engine_client import _calls as calls
from engine_client._base import ClientBase
from engine_client._codec import pack_tokens
from engine_client.step import StepBatch, StepWire, _record_maker, serialize_request
from engine_client.types import AppendResult, CloseResult, CommitResult, ExtendResult, MatchResult, OpenedSession
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
    s = fill_every_kind(batch)
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


def test_each_op_sent_as_a_message_is_the_request_its_unary_call_sends() -> None:
    """One description of each request: a Step op message is what the op's unary call sends (the Step's
    engine id stands in for each op's own)."""
    client = ClientBase("127.0.0.1:1", None, "")
    batch = StepBatch(columns=False)
    fill_every_kind(batch)
    ops = batch.request("").ops
    assert [getattr(op, op.WhichOneof("op")) for op in ops] == [
        calls.open_session(client, "new", False, 0.0, "t", "").request,
        calls.append_session(client, "s", [1, 2], 4, 7).request,
        calls.extend_session(client, "other", 8, 0).request,
        calls.commit_session(client, "s", [1, 2], 3, False, 2, 7).request,
        calls.commit_session(client, "other", b"", None, True, 0, 0).request,
        calls.close_session(client, "s", True, 7).request,
        calls.match_prefix([1, 2], "t").request,
    ]


def test_a_parent_and_a_close_mode_travel_the_same_in_columns_messages_and_alone() -> None:
    """docs/design.md §15: an open's parent_session_id and a close's mode, in each encoding."""
    client = ClientBase("127.0.0.1:1", None, "")
    batches = [StepBatch(), StepBatch(columns=False)]
    for batch in batches:
        batch.open("sub", parent_session_id="main")
        batch.close("sub", mode="keep-prefix")
        batch.close("main", cache=True)
    cols = batches[0].request("").columns
    assert (list(cols.parent_session_ids), cols.counts) == (
        ["main", "", ""], np.array([0, pb.CLOSE_MODE_KEEP_PREFIX, 0], dtype="<i4").tobytes())
    ops = batches[1].request("").ops
    assert [getattr(op, op.WhichOneof("op")) for op in ops] == [
        calls.open_session(client, "sub", True, None, "", "", "main").request,
        calls.close_session(client, "sub", False, 0, "keep-prefix").request,
        calls.close_session(client, "main", True, 0).request,
    ]
    assert ops[1].close.mode == pb.CLOSE_MODE_KEEP_PREFIX and ops[2].close.mode == pb.CLOSE_MODE_UNSPECIFIED
    with pytest.raises(ValueError, match="close mode 'forget' is not one of 'cache', 'drop', 'keep-prefix'"):
        StepBatch().close("sub", mode="forget")


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

    def GetPoolInfo(self, request: Any, **kwargs: Any) -> Any:
        """The clients ask once whether the service announces a step lane: this one does not."""
        if not self.asynchronous:
            return pb.GetPoolInfoResponse()

        async def answer() -> Any:
            return pb.GetPoolInfoResponse()

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


def test_a_batch_on_the_wire_is_the_request_protobuf_builds() -> None:
    """`wire()` writes the token ids after the other columns by hand: the bytes parse to the very request
    of protobuf's own building, for a batch with tokens, one without, and an empty one."""
    batch = StepBatch()
    fill_every_kind(batch)
    wire = batch.wire("eng-1")
    assert isinstance(wire, StepWire) and repr(wire) == f"StepWire({len(wire.data)} bytes)"
    # The columns, then each op's token ids as it copied them: the lane sends the parts gathered.
    assert wire.parts[1:] == (TOKENS, TOKENS, TOKENS) and wire.data == b"".join(wire.parts)
    assert wire.size == len(wire.data)
    expected = pb.StepRequest(engine_id="eng-1", columns=pb.StepColumns(
        kinds=bytes([1, 2, 3, 4, 4, 5, 6]), session_ids=["new", "s", "other", "s", "other", "s", ""],
        epochs=np.array([0, 7, 0, 7, 0, 7, 0], dtype="<u8").tobytes(),
        counts=np.array([0, 4, 8, 3, 0, 0, 0], dtype="<i4").tobytes(),
        flags=bytes([pb.STEP_FLAG_TIMEOUT, 0, 0, pb.STEP_FLAG_KV_TOKENS, pb.STEP_FLAG_SET, pb.STEP_FLAG_SET, 0]),
        token_counts=np.array([0, 2, 0, 2, 0, 0, 2], dtype="<u4").tobytes(), token_ids=TOKENS * 3,
        turns=np.array([0, 0, 0, 2, 0, 0, 0], dtype="<u4").tobytes(), timeouts=bytes(56),
        cache_salts=["t", "", "", "", "", "", "t"]))
    assert wire.message() == expected and (wire.engine_id, wire.columns) == ("eng-1", expected.columns)
    assert serialize_request(wire) == wire.data and serialize_request(expected) == expected.SerializeToString()
    with pytest.raises(RuntimeError, match="sent already"):
        batch.wire("eng-1")

    tokenless = StepBatch(engine_id="own")
    tokenless.extend("s", 16)
    assert tokenless.wire("eng-1").message() == pb.StepRequest(engine_id="own", columns=pb.StepColumns(
        kinds=bytes([3]), session_ids=["s"], counts=np.array([16], dtype="<i4").tobytes(), token_counts=bytes(4)))
    empty = StepBatch().wire("eng-1").message()
    assert empty.HasField("columns") and empty == pb.StepRequest(engine_id="eng-1", columns=pb.StepColumns())


def test_a_long_batch_on_the_wire_has_multi_byte_lengths() -> None:
    batch = StepBatch()
    prompt = np.arange(40_000, dtype=np.int32)  # 160,000 bytes: a 3-byte varint length
    for i in range(3):
        batch.append(f"s{i}", prompt[i:])
    message = batch.wire("e").message()
    assert message.columns.token_ids == b"".join(prompt[i:].tobytes() for i in range(3))
    assert np.frombuffer(message.columns.token_counts, "<u4").tolist() == [40_000, 39_999, 39_998]


def test_an_int32_array_packs_as_the_generic_path_does() -> None:
    prompt = np.arange(-3, 9, dtype=np.int32)
    assert pack_tokens(prompt) == prompt.astype(np.int64).astype("<i4").tobytes() == pack_tokens(prompt.tolist())
    assert pack_tokens(prompt[::3]) == np.array([-3, 0, 3, 6], dtype="<i4").tobytes()
    assert pack_tokens(prompt.astype(">i4")) == pack_tokens(prompt) and pack_tokens(prompt[:0]) == b""
    with pytest.raises(InvalidTokens):
        pack_tokens(prompt.reshape(3, 4))


@pytest.mark.parametrize("cls, values", [
    (OpenedSession, ("s", 7, 600.0, "i9")),
    (AppendResult, ("s", 7, 1, 16, 32, 48, 2, np.array([4, 5], dtype=np.int32), 4, 16, 3,
                    np.array([2, 0], dtype=np.int32))),
    (ExtendResult, ("s", 7, 1, 64, 3, np.array([6], dtype=np.int32), 4, np.array([1], dtype=np.int32))),
    (CommitResult, ("s", 66, 65, 5, False)),
    (CloseResult, ("s", True, 64)),
    (MatchResult, (32, np.array([4, 5], dtype=np.int32), 0, np.array([0, 3], dtype=np.int32))),
], ids=lambda v: v.__name__ if isinstance(v, type) else "")
def test_records_made_for_column_results_are_the_records_themselves(cls: type, values: tuple[Any, ...]) -> None:
    made = _record_maker(cls)(*values)
    plain = cls(*values)
    assert type(made) is cls and repr(made) == repr(plain)
    assert [getattr(made, n) is getattr(plain, n) for n in cls.__slots__] == [True] * len(values)
    assert made == plain  # the same page-id arrays: equal field by field
    for record in (made, plain):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(record, cls.__slots__[0], 1)
    if not any(isinstance(v, np.ndarray) for v in values):
        assert hash(made) == hash(plain)


def test_each_result_of_a_columns_answer_owns_its_slice_of_the_page_ids() -> None:
    batch = StepBatch()
    first = batch.extend("a", 16)
    second = batch.extend("b", 32)
    batch.wire("e")

    def col(*values: int) -> bytes:
        return np.array(values, dtype="<u4").tobytes()

    batch.apply(pb.StepResponse(columns=pb.StepColumnResults(
        codes=bytes(8), epochs=bytes(16), turns=col(1, 1), cached_tokens=col(0, 0), context_tokens=col(0, 0),
        capacity_tokens=col(16, 32), page_offsets=col(1, 1), num_pages=col(2, 3), prefix_hit_tokens=col(0, 0),
        kv_tokens=col(0, 0), closed=bytes(2), page_counts=col(1, 2), page_ids=col(7, 8, 9), timeouts=bytes(16),
        instance_id="i9")))
    pages = first.value.page_ids
    assert pages.tolist() == [7] and second.value.page_ids.tolist() == [8, 9] and pages.dtype == np.int32
    pages[0] = 100  # writable, and no other result sees it
    assert second.value.page_ids.tolist() == [8, 9] and first.value.page_ids.tolist() == [100]
    assert first.value is first.value and batch.opened_instance_ids() == []


def test_the_instance_id_is_learnt_from_an_open_that_succeeded() -> None:
    batch = StepBatch()
    batch.open("s")
    batch.open("t")
    batch.wire("e")
    refused = error_status(code_pb2.ALREADY_EXISTS, "SESSION_EXISTS", "exists")
    answer = pb.StepColumnResults(codes=np.array([code_pb2.ALREADY_EXISTS, 0], dtype="<i4").tobytes(),
                                  errors=[refused], opened_ids=["t"], instance_id="i9")
    assert batch.opened_instance_ids() == []  # not answered yet
    outcomes = batch.apply(pb.StepResponse(columns=answer))
    assert batch.opened_instance_ids() == ["i9"] and outcomes[1].value == OpenedSession("t", 0, 0.0, "i9")
    both_refused = StepBatch()
    both_refused.open("s")
    both_refused.wire("e")
    both_refused.apply(pb.StepResponse(columns=pb.StepColumnResults(
        codes=np.array([code_pb2.ALREADY_EXISTS], dtype="<i4").tobytes(), errors=[refused], instance_id="i9")))
    assert both_refused.opened_instance_ids() == []


def test_an_answer_as_messages_teaches_each_distinct_instance_id_of_its_successful_opens() -> None:
    batch = StepBatch(columns=False)
    for sid in ("s", "t", "u", "v"):
        batch.open(sid)
    batch.request("e")
    assert batch.opened_instance_ids() == []  # not answered yet
    batch.apply(pb.StepResponse(results=[
        pb.StepResult(open=pb.OpenSessionResponse(session_id="s", epoch=1, instance_id="i9")),
        pb.StepResult(status=error_status(code_pb2.ALREADY_EXISTS, "SESSION_EXISTS", "exists")),
        pb.StepResult(open=pb.OpenSessionResponse(session_id="u", epoch=1, instance_id="i9")),
        pb.StepResult(open=pb.OpenSessionResponse(session_id="v", epoch=1, instance_id="i10")),
    ]))
    assert batch.opened_instance_ids() == ["i9", "i10"]


def test_an_answer_with_the_wrong_number_of_opened_ids_is_refused_when_read() -> None:
    batch = StepBatch()
    opened = batch.open("s")
    batch.wire("e")
    batch.apply(pb.StepResponse(columns=pb.StepColumnResults(codes=bytes(4), opened_ids=["s", "t"], instance_id="i")))
    with pytest.raises(RuntimeError, match="2 opened ids for 1 opens"):
        _ = opened.value


def _one_by_one(batch: StepBatch, s: FakeSession, prompt: Any) -> list[Any]:
    return [batch.open("a", streaming=False), batch.open("b", streaming=False),
            batch.append("a", prompt, reserve_tokens=16), batch.append(s, [5, 6], reserve_tokens=16),
            batch.extend("a", 16), batch.extend(s, 16), batch.commit(s, [7]), batch.commit("a", []),
            batch.close("a", cache=True), batch.close(s, cache=True), batch.close("b", mode="drop")]


def _many(batch: StepBatch, s: FakeSession, prompt: Any) -> list[Any]:
    return [*batch.open_many(["a", "b"], streaming=False),
            *batch.append_many(["a", s], [prompt, [5, 6]], reserve_tokens=16),
            *batch.extend_many(["a", s], 16), *batch.commit_many([s, "a"], [[7], []]),
            *batch.close_many(["a", s], cache=True), *batch.close_many(["b"], mode="drop")]


def test_ops_added_many_at_a_time_are_the_ops_added_one_by_one() -> None:
    """The bulk methods append the very entries the op methods do: the same request on the wire, the same
    outcomes (kinds, positions), the same session objects taking their results."""
    prompt = np.arange(40, dtype=np.int32)
    one, many = StepBatch(), StepBatch()
    s1, s2 = FakeSession("s", 7), FakeSession("s", 7)
    expected, got = _one_by_one(one, s1, prompt), _many(many, s2, prompt)
    assert [(o.kind, o.index) for o in got] == [(o.kind, o.index) for o in expected]
    assert many.outcomes == got and len(many) == len(one) == 11
    assert many.wire("e").data == one.wire("e").data
    assert many._sessions.keys() == one._sessions.keys() == {3, 5, 6, 9}


def test_bulk_ops_refuse_mismatched_tokens_and_a_sent_batch() -> None:
    batch = StepBatch()
    with pytest.raises(ValueError, match="1 token sequences for 2 sessions"):
        batch.append_many(["a", "b"], [[1]])
    assert len(batch) == 0
    batch.wire("e")
    with pytest.raises(RuntimeError, match="this batch was sent already"):
        batch.extend_many(["a"], 16)


def test_failed_lists_the_refused_ops_at_once() -> None:
    batch = StepBatch()
    batch.extend_many(["a", "b", "c"], 16)
    batch.request("e")
    codes = np.array([0, code_pb2.FAILED_PRECONDITION, 0], dtype="<i4").tobytes()
    zeros = bytes(12)
    batch.apply(pb.StepResponse(columns=pb.StepColumnResults(
        codes=codes, errors=[error_status(code_pb2.FAILED_PRECONDITION, "NO_TURN_IN_FLIGHT", "no turn")],
        page_counts=zeros, instance_id="i")))
    assert batch.failed == [1]
    assert [o.ok for o in batch.outcomes] == [True, False, True]
    messages = StepBatch(columns=False)
    messages.extend_many(["a", "b"], 16)
    messages.request("e")
    messages.apply(pb.StepResponse(results=[
        pb.StepResult(status=error_status(code_pb2.NOT_FOUND, "SESSION_NOT_FOUND", "gone")),
        pb.StepResult(extend=pb.ExtendSessionResponse(session_id="b"))]))
    assert messages.failed == [0]
