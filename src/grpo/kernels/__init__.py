"""grpo's own CPU ops, compiled once per machine and loaded into PyTorch's dispatcher.

`cpu_ops()` is `torch.ops.grpo_cpu`: the native decode's attention (with RoPE and the KV-cache write),
RMSNorm and RoPE both ways, and SwiGLU's elementwise work both ways, each one op (`cpu_ops.cpp` says why),
or None where they are not available: no C++ compiler with OpenMP (Linux's g++ has it; Apple's clang does
not), a PyTorch without its headers, a failed build, or `GRPO_CPU_KERNELS=0` in the environment. Callers
then run the same computation as PyTorch's ops, so a missing compiler costs speed, never a run.

The library is built with the system's C++ compiler against the installed PyTorch the first time a
process asks for it (~10-40 s on two cores; `python -m grpo.kernels` builds it ahead, as `make setup`
does), into `$GRPO_KERNELS_DIR` or `~/.cache/grpo/kernels`, under a name that hashes the source, the
PyTorch version, the compiler flags and the instruction set: a cache shared between machines or PyTorch
builds never loads a library built for another. The build writes a temporary file and renames it, so
processes that build at once each end with a whole library.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger("grpo")

SOURCE = Path(__file__).with_name("cpu_ops.cpp")
_lock = threading.Lock()
_state: dict[str, object] = {}  # "op": the loaded op or None; "why": why not


def enabled() -> bool:
    return os.environ.get("GRPO_CPU_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def _isa_flags() -> list[str]:
    """Flags for the instruction set PyTorch itself dispatches to on this machine: the same vector width,
    and nothing newer than what every CPU of that class has (not -march=native: a home directory shared
    by machines of one class must not hand one of them an instruction it lacks)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.startswith("AVX512"):
        return [
            "-mavx512f",
            "-mavx512dq",
            "-mavx512bw",
            "-mavx512vl",
            "-mavx2",
            "-mfma",
            "-mprefer-vector-width=512",
        ]
    if capability == "AVX2":
        return ["-mavx2", "-mfma"]
    return []


def _build_command(out: Path) -> list[str]:
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or "c++"
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    libraries = cpp_extension.library_paths()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        compiler,
        *("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"),
        *_isa_flags(),
        *includes,
        str(SOURCE),
        *(f"-L{p}" for p in libraries),
        *(f"-Wl,-rpath,{p}" for p in libraries),
        *("-lc10", "-ltorch_cpu", "-ltorch"),
        "-o",
        str(out),
    ]


def library_path() -> Path:
    """Where this machine's build of the library is (or will be)."""
    root = Path(os.environ.get("GRPO_KERNELS_DIR") or Path.home() / ".cache" / "grpo" / "kernels")
    key = hashlib.sha256()
    key.update(SOURCE.read_bytes())
    key.update(torch.__version__.encode())
    key.update(" ".join(_build_command(Path("x"))).encode())
    return root / f"grpo_cpu_{key.hexdigest()[:16]}.so"


def build(path: Path) -> None:
    """Compile the library to `path` (atomically); raises RuntimeError with the compiler's output."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem + ".", suffix=".tmp")
    os.close(fd)
    try:
        command = _build_command(Path(tmp))
        try:
            done = subprocess.run(command, capture_output=True, text=True, check=False)
        except FileNotFoundError:
            raise RuntimeError(
                f"no C++ compiler found ({command[0]!r}; install g++, or point CXX at one)"
            ) from None
        if done.returncode != 0:
            output = done.stderr or done.stdout or ""
            first = next((line for line in output.splitlines() if "error" in line.lower()), "")
            first = first.strip() or f"{command[0]} exited with status {done.returncode}"
            raise RuntimeError(f"the C++ compiler failed: {first}\n{output[-3000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load() -> object | None:
    if not enabled():
        _state["why"] = "GRPO_CPU_KERNELS=0"
        return None
    if sys.platform not in ("linux", "darwin"):
        _state["why"] = f"not built on {sys.platform}"
        return None
    try:
        path = library_path()
        if not path.exists():
            start = time.perf_counter()
            log.info("building grpo's CPU ops for this machine (once; ~10-40 s): %s", path)
            build(path)
            log.info("built grpo's CPU ops in %.1f s", time.perf_counter() - start)
        torch.ops.load_library(str(path))
        return torch.ops.grpo_cpu
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        _state["why"] = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        log.warning(
            "grpo's CPU ops are not available (%s); decoding with PyTorch's ops instead, which is "
            "slower on a CPU. Set GRPO_CPU_KERNELS=0 to skip the build.",
            _state["why"],
        )
        return None


def cpu_ops():
    """`torch.ops.grpo_cpu`, built and loaded on first use, or None (unavailable, or GRPO_CPU_KERNELS=0,
    read at every call so that a process can compare both)."""
    if not enabled():
        return None
    if "op" not in _state:
        with _lock:
            if "op" not in _state:
                _state["op"] = _load()
    return _state["op"]


def why_unavailable() -> str | None:
    """After `cpu_ops()` returned None: why."""
    return _state.get("why")  # type: ignore[return-value]


def cpu_ops_for(*tensors: torch.Tensor):
    """`cpu_ops()` where every tensor is float32 on a CPU and torch.compile is not tracing (inductor fuses
    these ops' formulas itself there); else None: the caller runs PyTorch's ops."""
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
        return None
    if torch.compiler.is_compiling():
        return None
    return cpu_ops()
