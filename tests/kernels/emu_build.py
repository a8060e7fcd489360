"""Builds kernel sources with emulated x86 intrinsics into a ctypes library, for the kernel tests.

Kernels for instruction sets this CPU lacks (AVX-512 VNNI and BF16, AMX) cannot run in the
extension here, but their code can: `build()` compiles the kernel files unchanged with
`-DPAGEWIRE_X86_EMULATE` and `tests/kernels/emu/x86_emu.h` force-included, which defines the
intrinsics in portable C++ (SIMDe from Debian's libsimde-dev, `make sysdeps`; AMX tiles in
`tests/kernels/emu/amx_emu.h`). A small C shim (`tests/kernels/emu/shim_*.cpp`) gives ctypes a
plain entry point. This checks each kernel's arithmetic, tiling and tails, never its speed.
Nothing is fetched: g++ and the headers are already on the machine.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
EMU = ROOT / "tests" / "kernels" / "emu"
CPU_SRC = ROOT / "csrc" / "cpu"
SIMDE = Path("/usr/include/simde/x86/avx512.h")
# torch's headers, for the header-only c10 fp16 conversions elem.h uses (nothing of libtorch is linked).
TORCH_INCLUDE = Path(torch.__file__).resolve().parent / "include"


def build(name: str, sources: list[str]) -> ctypes.CDLL:
    """Compiles csrc/cpu/<sources> plus emu/shim_<name>.cpp (cached by content and flags) and loads it."""
    if shutil.which("g++") is None or not SIMDE.exists():
        pytest.skip("needs g++ and SIMDe (Debian's libsimde-dev; `make sysdeps` installs it)")
    files = [CPU_SRC / s for s in sources] + [EMU / f"shim_{name}.cpp"]
    deps = files + sorted(CPU_SRC.glob("*.h")) + sorted(EMU.glob("*.h"))
    # -O1, not -O2: SIMDe's inlined intrinsics make -O2's passes the build's cost. Zen 4 here,
    # linear_x8k_vnni.cpp took 272 s at -O2 and 57 s at -O1; every emulated test still runs
    # in under 2 s (bench/RESULTS.md, session 44).
    flags = ["-O1", "-std=c++17", "-fopenmp", "-fPIC", "-w", "-DPAGEWIRE_X86_EMULATE",
             "-include", str(EMU / "x86_emu.h"), f"-I{CPU_SRC}", f"-I{EMU}", f"-I{TORCH_INCLUDE}"]
    # The flags are part of the key: a library built with other flags is another library.
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in deps) + " ".join(flags).encode()).hexdigest()[:16]
    out = Path(tempfile.gettempdir()) / "pagewire-emu" / f"{name}-{digest}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        # One compiler per file, as many at once as there are cores: SIMDe's intrinsics make each file
        # minutes of work, and one g++ for all of them ran past a test's time limit on a busy machine.
        objs = [tmp.with_suffix(f".{i}.o") for i in range(len(files))]
        jobs = [["g++", *flags, "-c", str(src), "-o", str(obj)] for src, obj in zip(files, objs)]
        _run_parallel(name, jobs, os.cpu_count() or 1)
        _run_parallel(name, [["g++", "-fopenmp", "-shared", *map(str, objs), "-o", str(tmp)]], 1)
        for obj in objs:
            obj.unlink()
        os.replace(tmp, out)  # atomic: parallel test processes never load a half-written file
    return ctypes.CDLL(str(out))


def _run_parallel(name: str, cmds: list[list[str]], width: int) -> None:
    """Runs the commands, at most `width` at a time (waiting on the oldest); raises with the first
    failure's command and output."""
    running: list[tuple[list[str], subprocess.Popen[str]]] = []
    failed: list[str] = []
    for cmd in [*cmds, None]:
        while running and (cmd is None or len(running) >= width):
            args, proc = running.pop(0)
            _, err = proc.communicate()
            if proc.returncode != 0:
                failed.append(f"{' '.join(args)}\n{err[-4000:]}")
        if cmd is not None:
            running.append((cmd, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)))
    if failed:
        raise RuntimeError(f"emulated build of {name} failed:\n{failed[0]}")
