"""The one interceptor on kvcache.v1 methods: auth, restart detection, error mapping, metrics, logging.

Domain errors become their gRPC status with an ErrorInfo reason; any other exception becomes INTERNAL
with a fixed message and a logged traceback, and the service keeps serving. Health and reflection
pass through untouched (always open, so probes and grpcurl work without a token).
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import grpc.aio

from cache_service.core import KVCacheError, Reason
from cache_service.log import get_logger
from cache_service.metrics import Metrics
from cache_service.rpc.errors import status_for

SERVICE_PREFIX = "/kvcache.v1.KVCacheService/"
INSTANCE_HEADER = "x-kvcache-instance-id"
AUTH_HEADER = "authorization"

Behavior = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]


class ServiceInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc ships no types
    def __init__(self, metrics: Metrics, *, instance_id: str, auth_token: str = "") -> None:
        self._metrics = metrics
        self._instance_id = instance_id
        self._auth = f"Bearer {auth_token}".encode() if auth_token else b""
        self._log = get_logger("kvcache.rpc")
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method: str = details.method
        cached = self._wrapped.get(method)
        if cached is not None:
            return cached
        handler = await continuation(details)
        if handler is None or not method.startswith(SERVICE_PREFIX) or handler.unary_unary is None:
            return handler
        wrapped = grpc.unary_unary_rpc_method_handler(
            self._wrap(method[len(SERVICE_PREFIX):], handler.unary_unary),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
        self._wrapped[method] = wrapped
        return wrapped

    def _check_metadata(self, context: grpc.aio.ServicerContext) -> None:
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
        if self._auth and not hmac.compare_digest(auth, self._auth):
            raise KVCacheError(Reason.BAD_TOKEN, "missing or wrong 'authorization: Bearer <token>' metadata")

    def _wrap(self, name: str, behavior: Behavior) -> Behavior:
        log = self._log
        observe = self._metrics.observe_rpc

        def record(code: str, start: float) -> None:
            # Before the status leaves: an abort sends it to the client, so a metric recorded after the
            # abort could be missing from a scrape the client makes right after seeing the error.
            elapsed = time.perf_counter() - start
            observe(name, code, elapsed)
            log.debug("rpc", method=name, code=code, ms=round(elapsed * 1e3, 3))

        async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
            start = time.perf_counter()
            try:
                self._check_metadata(context)
                response = await behavior(request, context)
            except KVCacheError as e:
                record(e.code.value, start)
                log.warning("rpc_error", method=name, code=e.code.value, reason=e.reason.value, message=e.message)
                await context.abort_with_status(status_for(e))
            except grpc.aio.AbortError:
                raise  # a handler that aborted on its own has already sent its status
            except Exception:
                record("INTERNAL", start)
                log.exception("rpc_internal_error", method=name)
                await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {name}; see the service log")
            record("OK", start)
            return response

        return handle
