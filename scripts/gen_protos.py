"""Generate (or check) everything derived from protos/kvcache/v1/*.proto.

    python scripts/gen_protos.py          # write *_pb2.py, *_pb2.pyi, *_pb2_grpc.py beside the protos and
                                          # cache_service/core/reasons.py (the ErrorReason enum, pure Python)
    python scripts/gen_protos.py --check  # exit 1 naming the stale files if regeneration would differ

The core may not import protobuf, so the reasons and their status codes reach it as generated Python.
"""

from __future__ import annotations

import argparse
import filecmp
import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos" / "kvcache" / "v1"
REASONS = Path("cache_service") / "core" / "reasons.py"
_ENUM_TYPE, _ENUM_VALUE = 5, 2  # FileDescriptorProto.enum_type, EnumDescriptorProto.value


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


def generate(out_root: Path) -> list[Path]:
    """Write every generated file under `out_root` (mirroring the repo); return their repo-relative paths."""
    run_protoc(f"--python_out={out_root}", f"--pyi_out={out_root}", f"--grpc_python_out={out_root}")
    fds = descriptor_set(out_root / "kvcache.binpb")
    (out_root / REASONS).parent.mkdir(parents=True, exist_ok=True)
    (out_root / REASONS).write_text(reasons_module(fds))
    pb = sorted((out_root / "protos" / "kvcache" / "v1").glob("*_pb2*.py*"))
    return [p.relative_to(out_root) for p in pb] + [REASONS]


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
