"""Generate (or check) everything derived from protos/kvcache/v1/*.proto.

    python scripts/gen_protos.py          # write *_pb2.py, *_pb2.pyi, *_pb2_grpc.py beside the protos,
                                          # cache_service/core/reasons.py (the ErrorReason enum, pure Python) and
                                          # kvcache_common/stats.py (GetStats' records, pure Python)
    python scripts/gen_protos.py --check  # exit 1 naming the stale files if regeneration would differ

The core may not import protobuf, so the reasons and their status codes reach it as generated Python, and the
stats records (what the core counts, what the client reads) reach both sides as dataclasses generated from
`GetStatsResponse` and `ReuseStats`: a new counter is one proto field (and the core's count of it).
"""

from __future__ import annotations

import argparse
import filecmp
import importlib.util
import shutil
import sys
import tempfile
import textwrap
from collections.abc import Sequence
from pathlib import Path

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos" / "kvcache" / "v1"
REASONS = Path("cache_service") / "core" / "reasons.py"
STATS = Path("kvcache_common") / "stats.py"
_ENUM_TYPE, _ENUM_VALUE = 5, 2  # FileDescriptorProto.enum_type, EnumDescriptorProto.value
_MESSAGE_TYPE, _FIELD = 4, 2  # FileDescriptorProto.message_type, DescriptorProto.field
SERVICE_STATS_FIELDS = ("instance_id", "uptime_seconds", "physical_usage", "verified", "tier")
"""GetStatsResponse fields the service adds to what the core counts."""
UNRECORDED_STATS_FIELDS = {"tier": "the tier's own record is cache_service.tier.stats.TierStats"}
"""GetStatsResponse fields with no field in the generated records, and why."""
_PY_TYPES = {
    descriptor_pb2.FieldDescriptorProto.TYPE_DOUBLE: ("float", "0.0"),
    descriptor_pb2.FieldDescriptorProto.TYPE_FLOAT: ("float", "0.0"),
    descriptor_pb2.FieldDescriptorProto.TYPE_INT64: ("int", "0"),
    descriptor_pb2.FieldDescriptorProto.TYPE_UINT64: ("int", "0"),
    descriptor_pb2.FieldDescriptorProto.TYPE_INT32: ("int", "0"),
    descriptor_pb2.FieldDescriptorProto.TYPE_UINT32: ("int", "0"),
    descriptor_pb2.FieldDescriptorProto.TYPE_BOOL: ("bool", "False"),
    descriptor_pb2.FieldDescriptorProto.TYPE_STRING: ("str", '""'),
}


def include_dirs() -> list[Path]:
    """protobuf's well-known types (grpc_tools) and googleapis' google/rpc (googleapis-common-protos)."""
    rpc = importlib.util.find_spec("google.rpc.status_pb2")
    assert rpc is not None and rpc.origin is not None, "googleapis-common-protos is not installed"
    return [Path(protoc.__file__).parent / "_proto", Path(rpc.origin).parents[2]]


def protos() -> list[Path]:
    return sorted(PROTO_DIR.glob("*.proto"))


def run_protoc(*args: str) -> None:
    argv = ["protoc", f"-I{ROOT}", *[f"-I{d}" for d in include_dirs()], *args,
            *[str(p.relative_to(ROOT)) for p in protos()]]
    if protoc.main(argv) != 0:
        raise SystemExit("protoc failed (see above)")


def descriptor_set(out: Path) -> descriptor_pb2.FileDescriptorSet:
    """The protos with their imports and comments, as protoc sees them."""
    run_protoc(f"--descriptor_set_out={out}", "--include_imports", "--include_source_info")
    return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def _doc(comment: str) -> str:
    """A proto comment as one line, without `buf:lint` directives."""
    lines = (line.strip() for line in comment.splitlines())
    return " ".join(line for line in lines if line and not line.startswith("buf:lint"))


def reasons_module(fds: descriptor_pb2.FileDescriptorSet) -> str:
    """cache_service/core/reasons.py: `ErrorCode` and `Reason` with each reason's code and doc."""
    pool = descriptor_pool.DescriptorPool()
    for f in fds.file:
        pool.Add(f)
    status_code = pool.FindExtensionByName("kvcache.v1.status_code")
    options_cls = message_factory.GetMessageClass(pool.FindMessageTypeByName("google.protobuf.EnumValueOptions"))
    message_factory.GetMessageClassesForFiles([status_code.file.name], pool)
    rows: list[tuple[str, str, str]] = []
    for f in fds.file:
        for ei, enum in enumerate(f.enum_type):
            if enum.name != "ErrorReason":
                continue
            docs = {tuple(loc.path): loc.leading_comments for loc in f.source_code_info.location}
            for vi, value in enumerate(enum.value):
                if value.number == 0:
                    continue
                opts = options_cls.FromString(value.options.SerializeToString())
                code = opts.Extensions[status_code]
                if not code:
                    raise SystemExit(f"ErrorReason.{value.name} has no (status_code) option")
                doc = _doc(docs.get((_ENUM_TYPE, ei, _ENUM_VALUE, vi), ""))
                rows.append((value.name, code, doc))
    if not rows:
        raise SystemExit("kvcache.proto defines no ErrorReason enum")
    codes = sorted({code for _, code, _ in rows}, key=[c for _, c, _ in rows].index)
    out = [
        '"""Error reasons and the status code each is sent with.',
        "",
        "Generated from `enum ErrorReason` in protos/kvcache/v1/kvcache.proto by scripts/gen_protos.py: do not",
        "edit; change the proto and run `make proto`. `make proto-check` fails when this file is stale.",
        '"""',
        "",
        "from __future__ import annotations",
        "",
        "import enum",
        "",
        "",
        "class ErrorCode(enum.Enum):",
        '    """Transport-neutral status codes; the names are gRPC\'s, so the rpc layer maps them by name."""',
        "",
        *[f'    {c} = "{c}"' for c in codes],
        "",
        "",
        "class Reason(enum.Enum):",
        '    """Stable machine-readable reasons: the value is what clients see in ErrorInfo.reason."""',
        "",
    ]
    for name, _, doc in rows:
        out.append(f'    {name} = "{name}"')
        if doc:
            out.append(f'    """{doc}"""')
    out += [
        "",
        "    @property",
        "    def code(self) -> ErrorCode:",
        "        return _CODE_OF[self]",
        "",
        "    @property",
        "    def doc(self) -> str:",
        '        """What the reason means (its comment in the proto)."""',
        "        return _DOC_OF[self]",
        "",
        "",
        "_CODE_OF: dict[Reason, ErrorCode] = {",
        *[f"    Reason.{name}: ErrorCode.{code}," for name, code, _ in rows],
        "}",
        "_DOC_OF: dict[Reason, str] = {",
        *[f"    Reason.{name}:\n        {doc!r}," for name, _, doc in rows],
        "}",
        "",
    ]
    return "\n".join(out)


def _fields(fds: descriptor_pb2.FileDescriptorSet, message: str) -> list[tuple[str, str, str, str]]:
    """A kvcache message's fields as (name, Python type, default, doc), in the proto's order. A scalar maps to
    its Python type; a ReuseStats field to the generated record (a tuple of them when repeated)."""
    for f in fds.file:
        if f.package != "kvcache.v1":
            continue
        for mi, m in enumerate(f.message_type):
            if m.name != message:
                continue
            docs = {tuple(loc.path): loc.leading_comments for loc in f.source_code_info.location}
            rows = []
            for fi, field in enumerate(m.field):
                if field.name in UNRECORDED_STATS_FIELDS and message == "GetStatsResponse":
                    continue
                repeated = field.label == descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED
                if field.type_name == ".kvcache.v1.ReuseStats":
                    py, default = ("tuple[ReuseStats, ...]", "()") if repeated else ("ReuseStats", "ReuseStats()")
                elif field.type in _PY_TYPES and not repeated and not field.proto3_optional:
                    py, default = _PY_TYPES[field.type]
                else:
                    raise SystemExit(f"{message}.{field.name}: gen_protos.py has no record type for this field; map "
                                     "it in _fields, or name it in UNRECORDED_STATS_FIELDS with why")
                rows.append((field.name, py, default, _doc(docs.get((_MESSAGE_TYPE, mi, _FIELD, fi), ""))))
            return rows
    raise SystemExit(f"kvcache.proto defines no message {message}")


def _docstring(doc: str, indent: str = "    ") -> list[str]:
    """`doc` as a docstring wrapped at 116 columns."""
    lines = textwrap.wrap(f'"""{doc}"""', 116 - len(indent), break_on_hyphens=False)
    return [indent + line for line in lines]


def _record_lines(rows: list[tuple[str, str, str, str]], *, defaults: bool) -> list[str]:
    out = []
    for name, py, default, doc in rows:
        out.append(f"    {name}: {py}" + (f" = {default}" if defaults else ""))
        if doc:
            out += _docstring(doc)
    return out


def _message_doc(fds: descriptor_pb2.FileDescriptorSet, message: str) -> str:
    for f in fds.file:
        for mi, m in enumerate(f.message_type):
            if f.package == "kvcache.v1" and m.name == message:
                docs = {tuple(loc.path): loc.leading_comments for loc in f.source_code_info.location}
                return _doc(docs.get((_MESSAGE_TYPE, mi), ""))
    raise SystemExit(f"kvcache.proto defines no message {message}")


def _strings(names: Sequence[str]) -> str:
    return "(" + ", ".join(f'"{n}"' for n in names) + ")"


def stats_module(fds: descriptor_pb2.FileDescriptorSet) -> str:
    """kvcache_common/stats.py: `ReuseStats`, `CoreStats` (what the core counts) and `ServiceStats` (all that
    GetStats answers), frozen dataclasses with the proto's field names, order and comments."""
    stats = _fields(fds, "GetStatsResponse")
    unknown = set(SERVICE_STATS_FIELDS) - {name for name, *_ in stats} - set(UNRECORDED_STATS_FIELDS)
    if unknown:
        raise SystemExit(f"SERVICE_STATS_FIELDS names {sorted(unknown)}, which GetStatsResponse does not have")
    core = [row for row in stats if row[0] not in SERVICE_STATS_FIELDS]
    service = [row for row in stats if row[0] in SERVICE_STATS_FIELDS]
    out = [
        '"""GetStats\' records, both sides\' one declaration of them: what the core counts (`CoreStats`, the core\'s',
        "`Stats`), all that GetStats answers (`ServiceStats`, the engine client's `Stats`) and engines' reported reuse",
        "(`ReuseStats`). The service converts them to and from the proto by field name.",
        "",
        "Generated from `message GetStatsResponse` and `message ReuseStats` in protos/kvcache/v1/kvcache.proto by",
        "scripts/gen_protos.py: do not edit; change the proto and run `make proto`. `make proto-check` fails when",
        "this file is stale.",
        '"""',
        "",
        "from __future__ import annotations",
        "",
        "from dataclasses import dataclass",
        "",
        f"SERVICE_STATS_FIELDS = {_strings(SERVICE_STATS_FIELDS)}",
        '"""GetStatsResponse fields the service adds to what the core counts (`CoreStats`)."""',
        "UNRECORDED_STATS_FIELDS = {" + ", ".join(f'"{k}": "{v}"' for k, v in UNRECORDED_STATS_FIELDS.items()) + "}",
        '"""GetStatsResponse fields with no field here, and why."""',
        "",
        "",
        "@dataclass(frozen=True, slots=True)",
        "class ReuseStats:",
        *_docstring(_message_doc(fds, "ReuseStats")),
        "",
        *_record_lines(_fields(fds, "ReuseStats"), defaults=True),
        "",
        "",
        "@dataclass(frozen=True, slots=True, kw_only=True)",
        "class CoreStats:",
        '    """What the core counts, as GetStats sends it: every GetStatsResponse field but SERVICE_STATS_FIELDS.',
        "    Pages by state (free, evictable, radix_locked, session_held, in_flight, quarantined, loading) sum to",
        '    `num_pages - 1`."""',
        "",
        *_record_lines(core, defaults=False),
        "",
        "",
        "@dataclass(frozen=True, slots=True, kw_only=True)",
        "class ServiceStats(CoreStats):",
        '    """All that GetStats answers: `CoreStats` and the service\'s own fields."""',
        "",
        *_record_lines(service, defaults=False),
        "",
    ]
    return "\n".join(out)


def generate(out_root: Path) -> list[Path]:
    """Write every generated file under `out_root` (mirroring the repo); return their repo-relative paths."""
    run_protoc(f"--python_out={out_root}", f"--pyi_out={out_root}", f"--grpc_python_out={out_root}")
    fds = descriptor_set(out_root / "kvcache.binpb")
    (out_root / REASONS).parent.mkdir(parents=True, exist_ok=True)
    (out_root / REASONS).write_text(reasons_module(fds))
    (out_root / STATS).parent.mkdir(parents=True, exist_ok=True)
    (out_root / STATS).write_text(stats_module(fds))
    pb = sorted((out_root / "protos" / "kvcache" / "v1").glob("*_pb2*.py*"))
    return [p.relative_to(out_root) for p in pb] + [REASONS, STATS]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if the committed code is stale")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rel = generate(Path(tmp))
        if args.check:
            stale = [str(r) for r in rel if not (ROOT / r).exists() or not filecmp.cmp(Path(tmp) / r, ROOT / r,
                                                                                        shallow=False)]
            extra = [str(p.relative_to(ROOT)) for p in PROTO_DIR.glob("*_pb2*.py*")
                     if p.relative_to(ROOT) not in rel]
            if stale or extra:
                print(f"proto-check: stale generated code: {', '.join(stale + extra)}; run 'make proto'")
                return 1
            print(f"proto-check: {len(rel)} generated files are up to date")
            return 0
        for r in rel:
            shutil.copyfile(Path(tmp) / r, ROOT / r)
        print(f"proto: wrote {', '.join(str(r) for r in rel)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
