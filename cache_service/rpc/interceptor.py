"""The one interceptor on kvcache.v1 methods: decoding, auth, restart detection, error mapping, metrics, logs.

It is applied by wrapping each KVCacheService handler when the service is registered, not as a grpc.aio
`ServerInterceptor`: grpc.aio awaits an interceptor's `intercept_service` on every call of every method,
Health checks included, and wrapping costs nothing per call beyond the checks themselves.

Domain errors become their gRPC status with an ErrorInfo reason; any other exception becomes INTERNAL
with a fixed message and a logged traceback, and the service keeps serving. Request bytes that do not
decode are INVALID_ARGUMENT, counted and logged like any other error (grpc would answer UNKNOWN before
any of our code ran). Health and reflection are separate services, always open, so probes and grpcurl
work without a token.

The caller's identity (from its bearer token, see `identity.py`) is resolved here and handed to the
handler through `CALLER`, a context variable: each RPC runs in its own task, so it is per call.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio
from google.protobuf.message import DecodeError, Message

from cache_service.core import KVCacheError, Reason
from cache_service.log import debug_enabled, get_logger
from cache_service.metrics import Metrics
from cache_service.rpc.errors import status_for
from cache_service.rpc.identity import ANONYMOUS, Identities, Identity
from protos.kvcache.v1 import kvcache_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["KVCacheService"]
INSTANCE_HEADER = "x-kvcache-instance-id"
AUTH_HEADER = "authorization"

Behavior = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]
StreamBehavior = Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]

CALLER: contextvars.ContextVar[Identity] = contextvars.ContextVar("kvcache_caller", default=ANONYMOUS)
"""The identity of the call being handled (set by the interceptor before the handler runs)."""


class Malformed:
    """What a request that does not decode becomes: the handler answers INVALID_ARGUMENT for it."""

    __slots__ = ("error", "size")

    def __init__(self, error: Exception, size: int) -> None:
        self.error = error
        self.size = size


def _decoder(message_cls: type[Message]) -> Callable[[bytes], Message | Malformed]:
    parse = message_cls.FromString

    def decode(data: bytes) -> Message | Malformed:
        try:
            return parse(data)
        except (DecodeError, ValueError, RuntimeError) as e:  # upb raises DecodeError; keep the door shut
            return Malformed(e, len(data))

    return decode


def _nothing() -> None:
    return None


class ServiceInterceptor:
    def __init__(self, metrics: Metrics, *, instance_id: str, identities: Identities | None = None,
                 after: Callable[[], None] | None = None) -> None:
        self._metrics = metrics
        self._after = after or _nothing
        """Called after every call (the KV event hub's `poke`: the call may have changed the cache)."""
        self._instance_id = instance_id
        self._identities = identities or Identities()
        self._log = get_logger("kvcache.rpc")

    def service_handler(self, servicer: object) -> grpc.GenericRpcHandler:
        """KVCacheService's handlers, each of `servicer`'s methods wrapped by this interceptor."""
        handlers = {}
        for method in SERVICE.methods:
            request_cls = getattr(pb, method.input_type.name)
            response_cls = getattr(pb, method.output_type.name)
            if method.server_streaming:
                handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                    self._wrap_stream(method.name, getattr(servicer, method.name)),
                    request_deserializer=_decoder(request_cls),
                    response_serializer=response_cls.SerializeToString,
                )
            else:
                handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                    self._wrap(method.name, getattr(servicer, method.name),
                               "session_id" in method.input_type.fields_by_name),
                    request_deserializer=_decoder(request_cls),
                    response_serializer=response_cls.SerializeToString,
                )
        return grpc.method_handlers_generic_handler(SERVICE.full_name, handlers)

    def _check_metadata(self, context: grpc.aio.ServicerContext) -> None:
        """Check the instance header and resolve the caller (CALLER), or raise."""
        metadata = context.invocation_metadata() or ()
        auth = b""
        for key, value in metadata:
            if key == AUTH_HEADER:
                auth = value.encode() if isinstance(value, str) else value
            elif key == INSTANCE_HEADER and value != self._instance_id:
                raise KVCacheError(
                    Reason.INSTANCE_MISMATCH,
                    f"the client last talked to service instance {value}, this is {self._instance_id}: "
                    "the service restarted; remap the pool and reopen sessions",
                    expected=self._instance_id, got=value,
                )
        CALLER.set(self._identities.resolve(auth))

    def _check_request(self, name: str, request: Any, context: grpc.aio.ServicerContext) -> None:
        if type(request) is Malformed:
            raise KVCacheError(Reason.INVALID_ARGUMENT,
                               f"the {request.size}-byte request is not a valid {name} request message "
                               f"({request.error})", field="request")
        self._check_metadata(context)

    def _wrap(self, name: str, behavior: Behavior, has_session: bool = True) -> Behavior:
        """`behavior` with the checks, error mapping, metric and debug line; `has_session`: its request has a
        `session_id` (the debug line names it)."""
        log = self._log
        observe = self._metrics.observe_rpc

        def record(code: str, start: float, request: Any) -> None:
            # Before the status leaves: an abort sends it to the client, so a metric recorded after the
            # abort could be missing from a scrape the client makes right after seeing the error.
            elapsed = time.perf_counter() - start
            observe(name, code, elapsed)
            if not debug_enabled():
                return
            sid = getattr(request, "session_id", "") if has_session else ""
            if sid:
                log.debug("rpc", method=name, code=code, ms=round(elapsed * 1e3, 3), session_id=sid)
            else:
                log.debug("rpc", method=name, code=code, ms=round(elapsed * 1e3, 3))

        after = self._after

        async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
            start = time.perf_counter()
            try:
                self._check_request(name, request, context)
                response = await behavior(request, context)
                after()
            except KVCacheError as e:
                after()
                record(e.code.value, start, request)
                log.warning("rpc_error", method=name, code=e.code.value, reason=e.reason.value, message=e.message,
                            **e.metadata)
                await context.abort_with_status(status_for(e))
            except grpc.aio.AbortError:
                raise  # a handler that aborted on its own has already sent its status
            except Exception:
                after()
                record("INTERNAL", start, request)
                log.exception("rpc_internal_error", method=name)
                await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {name}; see the service log")
            record("OK", start, request)
            return response

        return handle

    def _wrap_stream(self, name: str, behavior: StreamBehavior) -> StreamBehavior:
        """The same checks for a server stream; its metrics record how long the stream lasted and how it
        ended (CANCELLED: the client went away, the usual end of a HoldLease)."""
        log = self._log
        observe = self._metrics.observe_rpc
        after = self._after

        async def handle(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            start = time.perf_counter()
            code = "OK"
            try:
                self._check_request(name, request, context)
                async for response in behavior(request, context):
                    yield response
            except KVCacheError as e:
                code = e.code.value
                log.warning("rpc_error", method=name, code=code, reason=e.reason.value, message=e.message,
                            **e.metadata)
                observe(name, code, time.perf_counter() - start)
                await context.abort_with_status(status_for(e))
            except grpc.aio.AbortError:
                code = ""  # a handler that aborted on its own has already sent its status
                raise
            except (asyncio.CancelledError, GeneratorExit):
                code = "CANCELLED"
                raise
            except Exception:
                code = "INTERNAL"
                log.exception("rpc_internal_error", method=name)
                observe(name, code, time.perf_counter() - start)
                await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {name}; see the service log")
            finally:
                after()
                if code in ("OK", "CANCELLED"):
                    observe(name, code, time.perf_counter() - start)
                    log.debug("rpc", method=name, code=code, ms=round((time.perf_counter() - start) * 1e3, 3))

        return handle
