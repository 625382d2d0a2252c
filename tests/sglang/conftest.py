"""Real SGLang on a real kvcache: SGLang CPU engines (`python -m engine_client.sglang.driver`, in
`.venv-sglang`, made by `make sglang-setup`) and `kvcache-service serve` processes on free loopback ports.

An engine takes 15-60 s to start here (minutes on a loaded machine), so the module starts its engines once,
together, and its tests share them, in the `vllm-c` xdist group (one worker). The model is a tiny
random-initialised Llama this module saves (float32, head_dim 64; nothing is downloaded). After every test
the kvcache service passes the accounting invariant.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from engine_client.sglang.driver import SglangProcess
from engine_client.vllm.driver import DriverError
from tests.integration.conftest import REPO

SGLANG_PYTHON = REPO / ".venv-sglang" / "bin" / "python"
PAGE = 16
LAYOUT = ("--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "64", "--dtype", "float32",
          "--page-size", str(PAGE))


class SglangEngine(SglangProcess):
    """A driver process in .venv-sglang; a failure to start or answer is a test failure with the engine's log."""

    def __init__(self, model: Path, log: Path, *, kvcache: str = "", engine_id: str = "",
                 streaming: bool = True) -> None:
        if not SGLANG_PYTHON.exists():
            raise AssertionError(f"{SGLANG_PYTHON} is missing: `make sglang-setup` makes the SGLang venv")
        args = ("--streaming",) if streaming else ()
        env = {"PYTHONPATH": str(REPO), "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "true"}
        try:
            super().__init__(SGLANG_PYTHON, model, log, kvcache=kvcache, args=args, cwd=REPO, env=env,
                             extra={"kvcache_engine_id": engine_id} if engine_id else None, start_timeout=600)
        except DriverError as e:
            raise AssertionError(str(e)) from None

    def command(self, cmd: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
        try:
            return super().command(cmd, timeout)
        except DriverError as e:
            raise AssertionError(str(e)) from None

    def children(self) -> list[int]:
        """The driver's child processes (SGLang's scheduler and detokenizer)."""
        out = []
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            text = (task / "children").read_text().split()
            out += [int(p) for p in text]
        return out

    def kill_all(self) -> None:
        """SIGKILL the driver and SGLang's processes (the scheduler holds the kvcache lease)."""
        for pid in self.children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        self.proc.kill()
        self.proc.wait(timeout=60)
        self._log.close()
