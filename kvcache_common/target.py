"""Service addresses as users type them, and what to say when no service answers at one.

One rule for every place a kvcache address is read (the service's `--listen`, the on-call commands'
`--target`, `KVCacheClient`, the vLLM connector's `kvcache_target`): an address without a port means the
service's port, 50051 (gRPC alone would dial 443 for `localhost`). docs/design.md §5.
"""

from __future__ import annotations

DEFAULT_PORT = 50051
DEFAULT_TARGET = f"127.0.0.1:{DEFAULT_PORT}"
START_HINT = "start one with `make run` (or `kvcache-service serve`)"
"""The command that starts a service, as the refusals of the commands that need one print it."""

_AS_IS = ("unix:", "unix-abstract:", "vsock:", "ipv4:", "ipv6:")
"""gRPC target schemes that carry no port to default (or carry their own)."""


def with_default_port(address: str) -> str:
    """`address` with port 50051 added when it names none: "localhost" -> "localhost:50051", "::1" ->
    "[::1]:50051", "[::1]" -> "[::1]:50051", "dns:///svc" -> "dns:///svc:50051"; "host:port", "unix:/path"
    and the other gRPC schemes are returned as given (as is "", which means "the default" to callers)."""
    address = address.strip()
    if not address or address.startswith(_AS_IS):
        return address
    if address.startswith("dns:"):
        head, sep, host = address.rpartition("/")
        if not sep:
            head, host = "dns:", address[len("dns:"):]
            return head + with_default_port(host)
        return f"{head}/{with_default_port(host)}"
    if address.startswith("["):
        return address if "]:" in address else f"{address}:{DEFAULT_PORT}"
    colons = address.count(":")
    if colons == 0:
        return f"{address}:{DEFAULT_PORT}"
    if colons > 1:  # an IPv6 address without brackets has no port
        return f"[{address}]:{DEFAULT_PORT}"
    return address


def refused(details: str) -> bool:
    """Whether gRPC's `details` of an UNAVAILABLE status say nothing listens at the address (a refused TCP
    connection, or a unix socket path that does not exist)."""
    lowered = details.lower()
    return "connection refused" in lowered or "no such file or directory" in lowered


def no_service(target: str) -> str:
    """The one line said when nothing listens at `target`: the target, and the command that starts a service."""
    return f"no kvcache service at {target} (connection refused); {START_HINT}"
