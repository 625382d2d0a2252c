"""The connector's settings: `kv_connector_extra_config` read into one checked object (no vLLM import).

    "kv_connector_extra_config": {"kvcache_target": "127.0.0.1:50051", "kvcache_token": "...",
                                  "tls_ca_file": "/run/tls/ca.crt"}

Keys (all optional):
- `kvcache_target`: host:port or unix:/path, a host alone meaning port 50051 (default: $KVCACHE_TARGET, else
  127.0.0.1:50051).
- `kvcache_token`: the bearer token (default: $KVCACHE_TOKEN).
- `tls_ca_file`, `tls_cert_file`, `tls_key_file`, `tls_server_name`: `ClientOptions`' TLS options.
- `kvcache_timeout_seconds`: deadline of every call to kvcache (default 2): a service that does not answer
  in time is "unreachable" and vLLM computes.
- `kvcache_reserve_tokens`: slots reserved after a prompt, and added each time a request's decode nears
  its capacity (default: vLLM's block_size).
- `kvcache_lookup_wait_seconds`: how long a scheduler step may wait for the Step that carries the
  lookups of the previous step before answering "ask again" (default 0.02).
- `kvcache_lookup_in_step`: when the engine ran nothing in its last step (so the lookup's step would be
  an empty one), a new request's lookup is sent at once and waited for, at most
  `kvcache_lookup_wait_seconds`, once a step, so it is answered in the step that asked (default false:
  measured on CPU it saved ~3 ms of a 140 ms TTFT and cost a burst of new requests a second wait).
- `kvcache_retry_seconds`: how often an unreachable kvcache is tried again (default 1).
- `kvcache_start_wait_seconds`: for this long after the connector starts, a request that comes before its
  first connection to kvcache (the lease not yet held: a start on a busy host) is answered "ask again"
  rather than computed (default 10; 0: compute at once). Past it vLLM computes, with one warning.

An unknown `kvcache_*` or `tls_*` key is refused at start (a typo would otherwise be ignored silently).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine_client._base import default_target
from engine_client.options import ClientOptions
from kvcache_common.target import with_default_port

__all__ = ["TOKEN_ENV", "ConnectorConfig", "ConnectorConfigError"]

TOKEN_ENV = "KVCACHE_TOKEN"

_TLS_KEYS = ("tls_ca_file", "tls_cert_file", "tls_key_file", "tls_server_name")
_FLOAT_KEYS = {"kvcache_timeout_seconds": 2.0, "kvcache_lookup_wait_seconds": 0.02, "kvcache_retry_seconds": 1.0,
               "kvcache_start_wait_seconds": 10.0}
_KNOWN = {"kvcache_target", "kvcache_token", "kvcache_reserve_tokens", "kvcache_lookup_in_step", *_TLS_KEYS,
          *_FLOAT_KEYS}


class ConnectorConfigError(ValueError):
    """A `kv_connector_extra_config` value the connector cannot use; the message names the key."""


@dataclass(frozen=True)
class ConnectorConfig:
    target: str
    options: ClientOptions
    reserve_tokens: int
    """0: vLLM's block_size."""
    lookup_wait_seconds: float
    retry_seconds: float
    lookup_in_step: bool = False
    start_wait_seconds: float = 10.0
    """Requests before the first connection ask again for this long after the start (then: computed)."""

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None) -> ConnectorConfig:
        """Read `kv_connector_extra_config`; raise ConnectorConfigError naming the first bad key."""
        extra = dict(extra or {})
        env = os.environ if env is None else env
        unknown = sorted(k for k in extra if (k.startswith(("kvcache_", "tls_"))) and k not in _KNOWN)
        if unknown:
            raise ConnectorConfigError(f"unknown kv_connector_extra_config key {unknown[0]!r}; the kvcache connector "
                                       f"knows {', '.join(sorted(_KNOWN))}")
        floats = {key: _number(extra, key, default) for key, default in _FLOAT_KEYS.items()}
        if floats["kvcache_timeout_seconds"] <= 0:
            raise ConnectorConfigError("kvcache_timeout_seconds must be > 0")
        if floats["kvcache_retry_seconds"] <= 0:
            raise ConnectorConfigError("kvcache_retry_seconds must be > 0")
        reserve = extra.get("kvcache_reserve_tokens", 0)
        if not isinstance(reserve, int) or isinstance(reserve, bool) or reserve < 0:
            raise ConnectorConfigError(f"kvcache_reserve_tokens must be an integer >= 0, got {reserve!r}")
        in_step = extra.get("kvcache_lookup_in_step", False)
        if not isinstance(in_step, bool):
            raise ConnectorConfigError(f"kvcache_lookup_in_step must be true or false, got {in_step!r}")
        tls = {key: extra.get(key, "") for key in _TLS_KEYS}
        for key, value in tls.items():
            if not isinstance(value, str):
                raise ConnectorConfigError(f"{key} must be a string, got {value!r}")
        target = extra.get("kvcache_target") or default_target()
        token = extra.get("kvcache_token") or env.get(TOKEN_ENV, "")
        if not isinstance(target, str) or not isinstance(token, str):
            raise ConnectorConfigError("kvcache_target and kvcache_token must be strings")
        target = with_default_port(target)
        try:
            options = ClientOptions(timeout_seconds=floats["kvcache_timeout_seconds"], auth_token=token, **tls)
        except ValueError as e:
            raise ConnectorConfigError(str(e)) from None
        return cls(target=target, options=options, reserve_tokens=reserve,
                   lookup_wait_seconds=max(0.0, floats["kvcache_lookup_wait_seconds"]),
                   retry_seconds=floats["kvcache_retry_seconds"], lookup_in_step=in_step,
                   start_wait_seconds=max(0.0, floats["kvcache_start_wait_seconds"]))


def _number(extra: Mapping[str, Any], key: str, default: float) -> float:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConnectorConfigError(f"{key} must be a number, got {value!r}")
    return float(value)
