"""`kvcache-service`: serve, and the on-call tools (stats, sessions, health).

Every command prints something useful on success and one line on failure. Bad flags exit 2.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from google.protobuf import json_format
from grpc_health.v1 import health_pb2

from cache_service import __version__
from cache_service.config import ConfigError, ServiceConfig, add_serve_arguments, config_from
from cache_service.log import configure_logging
from cache_service.memory import PoolError
from cache_service.memory.base import format_bytes
from kvcache_common.channel import ChannelSettings, TlsFileError, open_channel
from kvcache_common.heap import keep_heap
from kvcache_common.layout import GROUP_KINDS, PoolLayout, layer_words
from kvcache_common.target import DEFAULT_TARGET, no_service, refused, with_default_port
from protos.kvcache.v1 import kvcache_pb2 as pb

if TYPE_CHECKING:  # the on-call tools import grpc when they run (see main)
    import grpc

PROG = "kvcache-service"


class _Parser(argparse.ArgumentParser):
    """One-line refusals; no abbreviated flags (`--num-page 10` is refused, never taken as `--num-pages`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="kvcache: the KV-cache service of an LLM deployment.")
    p.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    serve = sub.add_parser("serve", help="run the service",
                           description="Run the service. Every flag is also an environment variable "
                                       "KVCACHE_<FLAG> (command line wins).")
    add_serve_arguments(serve)
    for name, text in (("stats", "print GetStats as a table"), ("sessions", "list open sessions"),
                       ("events", "follow WatchEvents: a snapshot of the radix and open sessions, then every "
                                  "change, one line per event (Ctrl-C stops)"),
                       ("health", "call grpc.health.v1 Health/Check; exit 0 when SERVING")):
        cmd = sub.add_parser(name, help=text, description=text)
        cmd.add_argument("--target", type=with_default_port,
                         default=with_default_port(os.environ.get("KVCACHE_TARGET") or DEFAULT_TARGET),
                         help="host:port or unix:/path, a host alone meaning port 50051 (default "
                              "$KVCACHE_TARGET, else 127.0.0.1:50051; now %(default)s)")
        cmd.add_argument("--timeout", type=float, default=5.0, help="seconds (default %(default)s)")
        cmd.add_argument("--auth-token", default="", help="bearer token, when the service requires one")
        tls = cmd.add_argument_group("TLS", "for a service started with --tls-cert; TLS is on when --tls-ca is "
                                            "given")
        tls.add_argument("--tls-ca", default="", metavar="FILE",
                         help="PEM CA bundle that signed the service's certificate")
        tls.add_argument("--tls-cert", default="", metavar="FILE",
                         help="PEM client certificate, for a service that requires one (mutual TLS)")
        tls.add_argument("--tls-key", default="", metavar="FILE", help="PEM private key of --tls-cert")
        tls.add_argument("--tls-server-name", default="", metavar="NAME",
                         help="name to check the service's certificate against instead of the target's host "
                              "(default: the host; localhost for a unix: target)")
        if name in ("stats", "sessions", "events"):
            cmd.add_argument("--json", action="store_true", help="print the response as JSON")
        if name == "sessions":
            cmd.add_argument("--parked", action="store_true",
                             help="only parked sessions (their engine's lease ended; any engine may adopt them)")
            cmd.add_argument("--former-engine", default="", metavar="ID",
                             help="only sessions parked at the end of this engine's lease")
        if name == "events":
            cmd.add_argument("--from-seq", type=int, default=0, metavar="SEQ",
                             help="resume at this batch while the service still buffers it (default: a snapshot)")
            cmd.add_argument("--count", type=int, default=0, metavar="N", help="stop after N events (0: never)")
        if name == "stats":
            cmd.add_argument("--verify", action="store_true", help="also run the full invariant check")
        if name == "health":
            cmd.add_argument("--service", default="", help="service name to check (default: overall)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command != "serve":
        # Read by grpc at its first import, which the on-call tools defer to here: grpc core would log a failed
        # TLS handshake at INFO on stderr, ahead of the command's one-line reason. An explicit value wins.
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    handlers = {"serve": _cmd_serve, "stats": _cmd_stats, "sessions": _cmd_sessions, "events": _cmd_events,
                "health": _cmd_health}
    try:
        code = handlers[args.command](args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
        return code
    except ConfigError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return _closed_pipe()


def _closed_pipe() -> int:
    """Stdout's reader left (`stats | head -1`): stop quietly, as a command killed by SIGPIPE would (exit
    141), and point stdout at /dev/null so the interpreter's flush at exit raises nothing either."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


# ------------------------------------------------------------------------------------------- serve


def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        config = config_from({k: v for k, v in vars(args).items() if k != "command"})
    except ConfigError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    configure_logging(config.log_level, config.log_format)
    keep_heap()  # large Step messages reuse freed heap instead of faulting it in again each call
    return asyncio.run(_serve(config))


async def _serve(config: ServiceConfig) -> int:
    from cache_service.app import KVCacheServer
    from cache_service.rpc.identity import TenantsFileError

    # Handlers first: a signal that arrives while starting (or right after the banner) stops cleanly too.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        server = KVCacheServer(config)
        await server.start()
    except (ConfigError, PoolError, TenantsFileError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    print(_banner(server), flush=True)
    await stop.wait()
    await server.stop()
    print(f"{PROG}: stopped cleanly (instance {server.instance_id}, pool released)", flush=True)
    return 0


def _banner(server: Any) -> str:
    cfg: ServiceConfig = server.config
    layout = server.pool.layout
    handle = server.pool.handle()
    where = handle.shm_path or f"GPU {handle.device_uuid}"
    if server.pool_socket is not None:
        where = ("memfd" if not handle.device_uuid else f"GPU {handle.device_uuid}") + \
            f", handed out on {server.pool_socket.address}"
    metrics = (f"http://{_host_for_url(cfg.metrics_host)}:{server.metrics_port}/metrics"
               if server.metrics_port is not None else "disabled (--metrics-port)")
    lines = [
        f"{PROG} {__version__} listening on {server.address} (instance {server.instance_id})",
        f"  backend  {server.pool.name}: {where} ({server.pool_why})",
        *_model_lines(cfg),
        f"  pool     {layout.num_pages - 1:,} pages x {layout.page_size} tokens = {layout.usable_tokens:,} tokens, "
        f"{format_bytes(layout.size_bytes)} ({layout.describe()})",
        *_group_lines(layout, cfg.window_prompt_ends),
        *_sizing_lines(server),
        f"  metrics  {metrics}",
        f"  auth     {_auth_line(server)}",
        *([f"  lane     Step also on {server.step_lane.path} (--step-lane false: gRPC only)"]
          if server.step_lane is not None else []),
        *_events_lines(server),
        *_tier_lines(server),
    ]
    if server.security == "mtls":
        lines.append(f"  tls      mtls: certificate {cfg.tls_cert}; clients must present a certificate signed by "
                     f"{cfg.tls_client_ca}")
    elif server.security == "tls":
        lines.append(f"  tls      tls: certificate {cfg.tls_cert}; no client certificates asked")
    lines.append(f"  try      {_grpcurl_line(server.address, server.security, cfg.tls_cert)}")
    return "\n".join(lines)


def _model_lines(cfg: ServiceConfig) -> list[str]:
    """What --model read, when it is set: the pool's layout came from it."""
    model = cfg.model_layout
    if model is None:
        return []
    dtype = "" if model.dtype == cfg.dtype else f"; KV dtype {cfg.dtype} (--dtype)"
    return [f"  model    {cfg.model}: {model.architecture}, {model.describe()}{dtype}"]


def _group_lines(layout: PoolLayout, prompt_ends: bool) -> list[str]:
    """With a sliding window: the pool's layer groups (GetPoolInfo's), pages whole across them or window rows
    apart (kept before each turn's end, and each prompt's end with `prompt_ends`)."""
    if not layout.sliding_window:
        return []
    groups = "; ".join(f"{GROUP_KINDS[g.kind]}{f' {g.sliding_window}' if g.sliding_window else ''} on "
                       f"{layer_words(g.layers, layout.num_layers)}" for g in layout.groups)
    if not layout.window_pages:
        return [f"  groups   {groups} (a page holds every layer's rows)"]
    full = len(layout.full_layers)
    return [f"  groups   {groups}",
            f"  window   {layout.window_pages - 1:,} window pages x {layout.page_size} tokens = "
            f"{(layout.window_pages - 1) * layout.page_size:,} tokens of the window layers' rows, "
            f"{format_bytes(layout.window_size_bytes)}; a page holds the {full} full-attention "
            f"{_layers(full)} rows ({format_bytes(layout.bytes_per_page)}), a window page the "
            f"{len(layout.window_layers)} window {_layers(len(layout.window_layers))} "
            f"({format_bytes(layout.bytes_per_window_page)})",
            f"           window rows kept before each turn's end{' and each prompt end' if prompt_ends else ''} "
            f"(--window-prompt-ends {str(prompt_ends).lower()})"]


def _layers(n: int) -> str:
    """The possessive of n layers: "layer's" for one, "layers'" for more."""
    return "layer's" if n == 1 else "layers'"


def _sizing_lines(server: Any) -> list[str]:
    """With --model: what sized the pool (free memory, or the flag) and the per-session cap it leaves."""
    cfg: ServiceConfig = server.config
    if cfg.model_layout is None:
        return []
    if server.pool_sized:
        sized = server.pool_sized
    elif cfg.gpu_memory_fraction:
        sized = f"--gpu-memory-fraction {cfg.gpu_memory_fraction:g}"
    else:
        sized = f"--pool-bytes {format_bytes(cfg.pool_bytes)}" if cfg.pool_bytes else f"--num-pages {cfg.num_pages}"
    cap = server.core.config.max_session_tokens
    capped = (f" (--max-session-tokens {cfg.max_session_tokens:,} is more than the pool holds)"
              if cfg.max_session_tokens > cap else " (--max-session-tokens)")
    return [f"  sizing   {sized}; a session holds at most {cap:,} tokens{capped}"]


# grpcurl checks the certificate against the host it dials: a wildcard bind address is no certificate's name.
_WILDCARD_HOSTS = ("0.0.0.0", "[::]", "::")


def _grpcurl_line(address: str, security: str, tls_cert: str) -> str:
    """A grpcurl command that lists the services. With TLS, `-cacert` names the server's own certificate,
    which grpcurl (Go) trusts as a pinned anchor, so it works with any CA; the certificate must name the
    host dialled (localhost for a unix socket or a wildcard bind address). With mutual TLS, `-cert`/`-key`
    are placeholders for a client certificate the client CA signed."""
    words = [tool_command("grpcurl")]
    if security == "plaintext":
        words.append("-plaintext")
    else:
        words += ["-cacert", os.path.abspath(tls_cert)]
        if security == "mtls":
            words += ["-cert", "CLIENT_CERT.pem", "-key", "CLIENT_KEY.pem"]
    if address.startswith("unix:"):
        if security != "plaintext":
            words += ["-servername", "localhost"]
        words += ["-unix", address[len("unix:"):]]
    else:
        host, _, port = address.rpartition(":")
        words.append(f"localhost:{port}" if security != "plaintext" and host in _WILDCARD_HOSTS else address)
    return " ".join([*words, "list"])


def _events_lines(server: Any) -> list[str]:
    """The KV events line, when --kv-events-endpoint is set."""
    hub = server.events
    if hub is None or hub.publisher is None:
        return []
    pub = hub.publisher
    replay = f", replay {pub.replay_endpoint}" if pub.replay_endpoint else ""
    return [f"  events   {pub.endpoint}{replay}, topic {pub.topic.decode()!r}, first seq {hub.last_seq}"]


def _tier_lines(server: Any) -> list[str]:
    """The tier line, when --tier is set."""
    tier = server.tier
    if tier is None:
        return []
    cfg: ServiceConfig = server.config
    state = "up" if tier.up else "DOWN (misses until the store answers; the service reconnects)"
    when = (f"while under {cfg.tier_watermark * 100:g}% free" if cfg.tier_policy == "write-back" else
            "as soon as cached")
    staging = tier.staging.slots if tier.staging is not None else 0
    return [f"  tier     {tier.backend.describe()}; {state}; loads wait at most {cfg.tier_timeout:g} s; "
            f"{cfg.tier_policy}: offloads {when}, pinning at most {cfg.tier_pin_fraction * 100:g}%; "
            f"eviction staging {staging:,} pages"]


def _auth_line(server: Any) -> str:
    cfg: ServiceConfig = server.config
    if cfg.tenants_file:
        names = server.identities.names
        return f"{len(names)} identities from {cfg.tenants_file} ({', '.join(names)})"
    if cfg.auth_token:
        return "one bearer token (--auth-token), an admin identity"
    return "none: every caller is admin (fine on loopback or a unix socket; see SECURITY.md)"


def tool_command(name: str) -> str:
    """How to run the tool `name` from here, as printed: its bare name when it is on PATH, else its path
    beside this Python (a virtual environment's bin, where `make` installs grpcurl), relative when under
    the current directory."""
    if shutil.which(name):
        return name
    beside = Path(sys.executable).parent / name
    if not beside.exists():
        return name
    try:
        return str(beside.relative_to(Path.cwd()))
    except ValueError:
        return str(beside)


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host else host


# ------------------------------------------------------------------------------------- on-call tools


_TLS_FLAGS = {"tls_ca_file": "--tls-ca", "tls_cert_file": "--tls-cert", "tls_key_file": "--tls-key"}


def _channel_settings(args: argparse.Namespace) -> ChannelSettings:
    """The on-call command's TLS settings; a bad combination is a ConfigError naming the flag (exit 2)."""
    if bool(args.tls_cert) != bool(args.tls_key):
        flag, other = ("--tls-cert", "--tls-key") if args.tls_cert else ("--tls-key", "--tls-cert")
        raise ConfigError(f"{flag}: needs {other} (a client certificate and its key go together)")
    for given, flag in ((args.tls_cert, "--tls-cert"), (args.tls_server_name, "--tls-server-name")):
        if given and not args.tls_ca:
            raise ConfigError(f"{flag}: needs --tls-ca, the CA bundle that signed the service's certificate (TLS "
                              "is on when --tls-ca is given)")
    return ChannelSettings(tls_ca_file=args.tls_ca, tls_cert_file=args.tls_cert, tls_key_file=args.tls_key,
                           tls_server_name=args.tls_server_name)


def _channel(args: argparse.Namespace) -> grpc.Channel:
    """A channel to --target, over TLS when --tls-ca is given; a bad TLS file is a ConfigError naming it."""
    import grpc

    try:
        return open_channel(args.target, _channel_settings(args), grpc.insecure_channel, grpc.secure_channel,
                            grpc.ssl_channel_credentials)
    except TlsFileError as e:
        raise ConfigError(f"{_TLS_FLAGS[e.option]}: {e.detail}") from None


def _stub(channel: grpc.Channel) -> Any:
    from protos.kvcache.v1 import kvcache_pb2_grpc as pb_grpc

    return pb_grpc.KVCacheServiceStub(channel)  # type: ignore[no-untyped-call]  # generated without types


def _metadata(args: argparse.Namespace) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {args.auth_token}")] if args.auth_token else []


def _fail(args: argparse.Namespace, e: grpc.RpcError) -> int:
    import grpc

    if e.code() is grpc.StatusCode.UNAVAILABLE and refused(e.details() or ""):
        print(f"{PROG}: {args.command}: {no_service(args.target)}", file=sys.stderr)
    else:
        print(f"{PROG}: {args.command} {args.target}: {e.code().name}: {e.details()}", file=sys.stderr)
    return 1


def _cmd_stats(args: argparse.Namespace) -> int:
    import grpc

    with _channel(args) as ch:
        try:
            st = _stub(ch).GetStats(pb.GetStatsRequest(verify=args.verify),
                                                         timeout=args.timeout, metadata=_metadata(args))
        except grpc.RpcError as e:
            return _fail(args, e)
    if args.json:
        print(json_format.MessageToJson(st, always_print_fields_with_no_presence=True,
                                      preserving_proto_field_name=True))
        return 0
    print(format_stats(st))
    return 0


def format_stats(st: pb.GetStatsResponse) -> str:
    usable = st.num_pages - 1
    w = len(f"{usable:,}")

    def pages(n: int) -> str:
        return f"{n:>{w},}  {100 * n / usable:5.1f}%"

    rows = [
        ("instance", st.instance_id),
        ("uptime", f"{st.uptime_seconds:.0f} s"),
        ("pool", f"{usable:,} pages x {st.page_size} tokens"),
        ("  free", pages(st.free_pages)),
        ("  evictable", pages(st.evictable_pages)),
        ("  radix_locked", pages(st.radix_locked_pages)),
        ("  session_held", pages(st.session_held_pages)),
        ("  in_flight", pages(st.in_flight_pages)),
        ("  quarantined", pages(st.quarantined_pages)),
        ("physical usage", f"{100 * st.physical_usage:.1f}%"),
        ("session budget", f"{st.session_budget_pages:,} pages" if st.session_budget_pages else "none"),
        ("sessions", f"{st.sessions_idle} idle, {st.sessions_in_turn} in turn, {st.sessions_closing} closing, "
                     f"{st.sessions_demoted} demoted, {st.sessions_parked} parked"),
        ("engines", f"{st.engines}"),
        ("tokens (cumulative)", f"{st.prefix_hit_tokens:,} radix hit, {st.session_hit_tokens:,} session hit, "
                                f"{st.miss_tokens:,} computed"),
        *reuse_rows(st),
        ("events", f"{st.evicted_pages:,} pages evicted, {st.duplicate_pages:,} duplicate, "
                   f"{st.demoted_sessions} demotions, {st.reaped_sessions} reaped, {st.expired_leases} leases expired, "
                   f"{st.parked_sessions} parked, {st.adopted_sessions} adopted, {st.expired_parked_sessions} parked "
                   "expired"),
        ("relief by class", f"evicted {st.evicted_closed_child_pages:,} closed-child, {st.evicted_ordinary_pages:,} "
                            f"ordinary, {st.evicted_parent_pages:,} parent pages; demoted "
                            f"{st.demoted_session_pages:,} idle-session, {st.demoted_parent_pages:,} parent pages"),
    ]
    if st.window_pages:
        rows.append(("window pages", f"{st.window_held_pages:,} held, {st.window_free_pages:,} free of "
                                     f"{st.window_pages:,}; freed {st.window_policy_dropped_pages:,} at commits, "
                                     f"{st.window_pressure_dropped_pages:,} under pressure; "
                                     f"{st.window_evicted_pages:,} pages evicted for window rows; "
                                     f"{st.window_cut_hit_tokens:,} hit tokens cut"))
    if st.HasField("tier"):
        rows += tier_rows(st.tier)
        rows.append(("  pool pages", f"{st.loading_pages:,} loading, {st.offloading_pages:,} offloading, "
                                     f"{st.tier_stored_pages:,} stored in the tier; {st.evicted_unstored_pages:,} "
                                     "evicted unstored"))
    if st.verified:
        rows.append(("invariant check", "passed"))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def reuse_rows(st: pb.GetStatsResponse) -> list[tuple[str, str]]:
    """What engines reported at their commits, in total and per engine: kvcache's match beside where each
    context token's KV came from (docs/design.md §5)."""

    def figures(r: pb.ReuseStats) -> str:
        return (f"{r.turns:,} turns: {r.matched_tokens:,} matched; {r.engine_cached_tokens:,} engine-cached, "
                f"{r.loaded_tokens:,} loaded, {r.computed_tokens:,} computed")

    if not st.reuse.turns:
        return [("reuse (engines)", "none reported")]
    return [("reuse (engines)", figures(st.reuse))] + [(f"  {r.engine_id or '(no engine)'}", figures(r))
                                                         for r in st.engine_reuse]


def tier_rows(t: pb.TierStats) -> list[tuple[str, str]]:
    """The tier's part of `stats`: state, hits, loads, offloads, errors and what it holds."""

    def per_page(seconds: float, pages: int) -> str:
        return f", {1000 * seconds / pages:.2f} ms/page" if pages else ""

    errors = ", ".join(f"{e.operation}:{e.reason} {e.count:,}" for e in t.errors) or "none"
    rows = [
        ("tier", f"{t.backend}, {'up' if t.up else 'DOWN'}" + (f", {t.outages} outage(s)" if t.outages else "")),
        ("  hits", f"{t.hit_pages:,} pages hit, {t.miss_pages:,} missed ({t.lookup_pages:,} looked up)"),
        ("  loads", f"{t.load_pages:,} pages, {format_bytes(t.load_bytes)} in {t.load_seconds:.3f} s"
                    f"{per_page(t.load_seconds, t.load_pages)}; {t.load_timeouts:,} timed out; "
                    f"{t.load_queue_pages:,} pages loading"),
        ("  offloads", f"{t.offload_pages:,} pages, {format_bytes(t.offload_bytes)} in {t.offload_seconds:.3f} s"
                       f"{per_page(t.offload_seconds, t.offload_pages)}; {t.offload_dropped_pages:,} dropped; "
                       f"queue {t.queue_pages:,}/{t.queue_capacity_pages:,} pages"),
        ("  staging", f"{t.staging_pages:,}/{t.staging_capacity_pages:,} pages waiting; {t.staged_pages:,} staged at "
                      f"eviction, {t.staging_written_pages:,} written, {t.staging_hit_pages:,} loaded from staging; "
                      f"lost {t.staging_dropped_pages:,} (no room) + {t.staging_lost_pages:,} (never written)"),
        ("  errors", errors),
    ]
    if t.HasField("stored_values"):
        rows.append(("  stored", f"{t.stored_values:,} values, {format_bytes(t.stored_bytes)} of "
                                 f"{format_bytes(t.capacity_bytes)}"))
    return rows


def _cmd_sessions(args: argparse.Namespace) -> int:
    """Every session the caller may see, read page by page (in the order they were opened)."""
    import grpc

    res = pb.ListSessionsResponse()
    with _channel(args) as ch:
        stub = _stub(ch)
        token = ""
        try:
            while True:
                wanted = pb.SESSION_STATE_PARKED if args.parked else pb.SESSION_STATE_UNSPECIFIED
                request = pb.ListSessionsRequest(page_token=token, former_engine_id=args.former_engine, state=wanted)
                page = stub.ListSessions(request, timeout=args.timeout, metadata=_metadata(args))
                res.sessions.extend(page.sessions)
                res.total = page.total
                token = page.next_page_token
                if not token:
                    break
        except grpc.RpcError as e:
            return _fail(args, e)
    if args.json:
        print(json_format.MessageToJson(res, always_print_fields_with_no_presence=True,
                                      preserving_proto_field_name=True))
        return 0
    header = (f"{'session':<34} {'state':<8} {'mode':<9} {'turns':>5} {'tokens':>7} {'pages':>6} {'idle s':>7}  "
              "engine  identity  parent")
    lines = [header]
    for s in res.sessions:
        state = pb.SessionState.Name(s.state).removeprefix("SESSION_STATE_")
        mode = "streaming" if s.streaming else "regular"
        lines.append(f"{s.session_id[:34]:<34} {state:<8} {mode:<9} {s.turns:>5} {s.context_tokens:>7} "
                     f"{s.num_pages:>6} {s.idle_seconds:>7.1f}  {_engine_cell(s)}  {s.identity or '-'}  "
                     f"{_parent_cell(s)}")
    lines.append(f"{len(res.sessions)} session(s)")
    print("\n".join(lines))
    return 0


def _parent_cell(s: pb.SessionInfo) -> str:
    """The session it works for, and how many children it has (docs/design.md §15)."""
    cell = s.parent_session_id or "-"
    return f"{cell} ({s.child_sessions} children)" if s.child_sessions else cell


def _engine_cell(s: pb.SessionInfo) -> str:
    """The owner, or for a parked session the engine it outlived and how long it stays parked."""
    if s.state != pb.SESSION_STATE_PARKED:
        return s.engine_id or "-"
    left = f"{s.parked_seconds_left:.0f}s left" if s.HasField("parked_seconds_left") else "no timeout"
    return f"- (parked from {s.former_engine_id}, {left})"


def _cmd_events(args: argparse.Namespace) -> int:
    """One line per event (or one JSON object per batch with --json) until Ctrl-C or --count events."""
    import grpc

    shown = 0
    with _channel(args) as ch:
        try:
            stream = _stub(ch).WatchEvents(pb.WatchEventsRequest(from_seq=args.from_seq), metadata=_metadata(args))
            for batch in stream:
                if args.json:
                    print(json_format.MessageToJson(batch, indent=None, preserving_proto_field_name=True), flush=True)
                    shown += len(batch.events)
                else:
                    for event in batch.events:
                        print(format_event(batch, event), flush=True)
                        shown += 1
                        if args.count and shown >= args.count:
                            break
                if args.count and shown >= args.count:
                    stream.cancel()
                    return 0
        except grpc.RpcError as e:
            if e.code() is grpc.StatusCode.CANCELLED and args.count and shown >= args.count:
                return 0
            return _fail(args, e)
    return 0


def _hashes(hashes: Sequence[int]) -> str:
    if len(hashes) <= 2:
        return ",".join(f"{h:016x}" for h in hashes)
    return f"{hashes[0]:016x}..{hashes[-1]:016x}"


def format_event(batch: pb.WatchEventsResponse, event: pb.KvEvent) -> str:
    """`seq <n> [snapshot] <what> <details>` for one event."""
    head = f"seq {batch.seq}{' snapshot' if batch.snapshot else ''}"
    kind = event.WhichOneof("event")
    if kind == "stored":
        e = event.stored
        parent = f"{e.parent_block_hash:016x}" if e.HasField("parent_block_hash") else "-"
        return (f"{head} stored salt={e.cache_salt!r} pages={len(e.block_hashes)} hashes={_hashes(e.block_hashes)} "
                f"parent={parent} tokens={len(e.token_ids)} medium={e.medium}"
                + (" window_rows_only" if e.window_rows_only else ""))
    if kind == "removed":
        r = event.removed
        return (f"{head} removed salt={r.cache_salt!r} pages={len(r.block_hashes)} hashes={_hashes(r.block_hashes)}"
                + (" window_rows_only" if r.window_rows_only else ""))
    if kind == "cleared":
        return f"{head} cleared"
    if kind == "session_opened":
        o = event.session_opened
        return (f"{head} session opened {o.session_id} epoch={o.epoch} {'streaming' if o.streaming else 'regular'} "
                f"salt={o.cache_salt!r} engine={o.engine_id or '-'}"
                + (f" parent={o.parent_session_id}" if o.parent_session_id else ""))
    if kind == "session_parked":
        parked = event.session_parked
        return (f"{head} session parked {parked.session_id} epoch={parked.epoch} "
                f"former_engine={parked.former_engine_id or '-'}")
    if kind == "session_adopted":
        adopted = event.session_adopted
        return f"{head} session adopted {adopted.session_id} epoch={adopted.epoch} engine={adopted.engine_id or '-'}"
    if kind == "session_closed":
        c = event.session_closed
        why = pb.SessionCloseReason.Name(c.reason).removeprefix("SESSION_CLOSE_REASON_").lower()
        return f"{head} session closed {c.session_id} epoch={c.epoch} reason={why}"
    detail = getattr(event, kind)
    return f"{head} session {kind.removeprefix('session_')} {detail.session_id} epoch={detail.epoch}"


def _cmd_health(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2_grpc

    with _channel(args) as ch:
        try:
            res = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=args.service),
                                                       timeout=args.timeout)
        except grpc.RpcError as e:
            return _fail(args, e)
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(res.status)
    print(f"{args.target}: {status}")
    return 0 if res.status == health_pb2.HealthCheckResponse.SERVING else 1
