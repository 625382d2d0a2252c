"""The client's typed-error table covers exactly the proto's ErrorReason, each in its code's family."""

from __future__ import annotations

import grpc
import pytest

from engine_client import errors
from protos.kvcache.v1 import kvcache_pb2 as pb

PROTO_REASONS = {v.name: v.GetOptions().Extensions[pb.status_code]
                 for v in pb.ErrorReason.DESCRIPTOR.values if v.number}
FAMILIES: dict[str, type[errors.KVCacheClientError]] = {
    "RESOURCE_EXHAUSTED": errors.ResourceExhausted,
    "INVALID_ARGUMENT": errors.InvalidArgument,
}


def test_every_proto_reason_has_exactly_one_typed_error() -> None:
    assert set(errors.REASON_ERRORS) == set(PROTO_REASONS)


@pytest.mark.parametrize(("reason", "code"), sorted(PROTO_REASONS.items()))
def test_a_reason_raises_its_class_whatever_the_code_says(reason: str, code: str) -> None:
    cls = errors.REASON_ERRORS[reason]
    if code in FAMILIES:
        assert issubclass(cls, FAMILIES[code]), f"{reason} ({code}) should be a {FAMILIES[code].__name__}"
    assert getattr(grpc.StatusCode, code)  # the option names a real gRPC code
