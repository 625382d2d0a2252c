"""What the sync and asyncio clients share: target resolution, call metadata, and restart detection."""

from __future__ import annotations

import os

from engine_client._lane import LaneChoice
from engine_client.errors import restarted
from engine_client.options import ClientOptions
from kvcache_common.heap import keep_heap
from kvcache_common.target import DEFAULT_TARGET, with_default_port

INSTANCE_HEADER = "x-kvcache-instance-id"
TARGET_ENV = "KVCACHE_TARGET"

Metadata = tuple[tuple[str, str], ...]


def default_target() -> str:
    """$KVCACHE_TARGET (the Helm chart sets it in sidecar engine containers), else 127.0.0.1:50051; an address
    without a port means 50051."""
    return with_default_port(os.environ.get(TARGET_ENV) or DEFAULT_TARGET)


class ClientBase:
    """The client learns the service's instance id from the first response that carries one and then
    sends it on every session and lease call ("pinned" metadata); a restarted service answers
    INSTANCE_MISMATCH, raised as `ServiceRestarted`, before a stale page id can be used."""

    def __init__(self, target: str | None, options: ClientOptions | None, engine_id: str) -> None:
        self.target = with_default_port(target or "") or default_target()
        self.options = options or ClientOptions()
        self.engine_id = engine_id
        """Default owner for sessions opened by this client (set by register_engine)."""
        self.instance_id = ""
        token = self.options.auth_token
        self._base_md: Metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._md: Metadata = self._base_md
        self._lane_choice = LaneChoice()
        """Whether Steps take the step lane (learnt from GetPoolInfo; see `_lane`)."""
        keep_heap()  # once per process: large Step messages reuse freed heap (kvcache_common/heap.py)

    def _metadata(self, pinned: bool) -> Metadata:
        return self._md if pinned else self._base_md

    def _learn(self, instance_id: str) -> None:
        if not self.instance_id:
            self.instance_id = instance_id
            self._md = (*self._base_md, (INSTANCE_HEADER, instance_id))
        elif instance_id != self.instance_id:
            raise restarted(self.instance_id, instance_id)

    def forget_instance(self) -> None:
        """Accept a restarted service: the next response's instance id becomes the known one."""
        self.instance_id = ""
        self._md = self._base_md
