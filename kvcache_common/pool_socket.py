"""The pool socket's protocol, shared by the service and the engine client (like `layout.py`).

Backends whose pool is a file descriptor (`host_memfd`, `cuda_vmm`) hand it to engines over a unix
socket with SCM_RIGHTS. One exchange per connection, each message one JSON object (UTF-8, at most
`MAX_MESSAGE` bytes):

    engine  -> service   {"version": 1, "token": "<bearer token or empty>", "instance_id": "<from GetPoolInfo>"}
    service -> engine    {"ok": true, "backend": ..., "instance_id": ..., "size_bytes": N, "device_uuid": ...}
                         with the pool's fd attached, or
                         {"ok": false, "code": "PERMISSION_DENIED", "reason": "ROLE_REQUIRED", "message": ...}

The service checks the peer's credentials (SO_PEERCRED) and the token's identity exactly as its RPCs do
before it sends anything. An `instance_id` that is not the service's gets INSTANCE_MISMATCH: the engine
is talking to a restarted service and must remap.
"""

from __future__ import annotations

import json
from typing import Any

VERSION = 1
MAX_MESSAGE = 4096
"""Largest message either side sends or accepts."""


def socket_address(name: str) -> str:
    """The address `socket.connect`/`bind` take: "@name" is Linux's abstract namespace ("\\0name")."""
    return "\0" + name[1:] if name.startswith("@") else name


def encode(message: dict[str, Any]) -> bytes:
    data = json.dumps(message, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE:
        raise ValueError(f"pool socket message of {len(data)} bytes exceeds {MAX_MESSAGE}")
    return data


def decode(data: bytes) -> dict[str, Any]:
    """A message, or ValueError naming what is wrong with it."""
    try:
        message = json.loads(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"not a JSON message ({e})") from None
    if not isinstance(message, dict):
        raise ValueError("not a JSON object")
    return message
