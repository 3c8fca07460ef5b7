"""Compiles a ``.cu`` file of this package into a shared library with ``nvcc`` (or, for the
CPU tests, with a C++ compiler for the host) and loads it with ctypes; the caller keeps the
library (``row_topk``: once a process and architecture).

The library is cached under ``$CPPLAN_CUDA_CACHE`` (default ``$XDG_CACHE_HOME/cpplan/cuda``,
else ``~/.cache/cpplan/cuda``), named by a hash of the source, the nvcc version and the flags,
written to a temporary file and renamed into place (ranks building at once each get a whole
file). nvcc: ``$CPPLAN_NVCC``, else the one on PATH, else ``$CUDA_HOME/bin/nvcc``, else
``/usr/local/cuda/bin/nvcc``; ``$CPPLAN_NVCC_CCBIN`` passes nvcc a host compiler. The CUDA
runtime is linked statically: the library launches on the stream it is given (torch's), in
the context current to the thread (torch's primary context).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
COMPILE_TIMEOUT_S = 600


class CudaBuildError(RuntimeError):
    """No nvcc, or nvcc failed: one line, the reason (the compiler's last lines on failure)."""


def find_nvcc() -> str | None:
    for cand in (os.environ.get("CPPLAN_NVCC"), shutil.which("nvcc"),
                 os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc")
                 if os.environ.get("CUDA_HOME") else None,
                 "/usr/local/cuda/bin/nvcc"):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def cache_dir() -> Path:
    if os.environ.get("CPPLAN_CUDA_CACHE"):
        return Path(os.environ["CPPLAN_CUDA_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cpplan" / "cuda"


def flags(arch: str) -> list[str]:
    """nvcc's flags for ``arch`` ("90": sm_90), output and source excluded."""
    out = ["-O3", "-lineinfo", "-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}",
           "-Xcompiler", "-fPIC", "-shared", "-cudart", "static"]
    if os.environ.get("CPPLAN_NVCC_CCBIN"):
        out += ["-ccbin", os.environ["CPPLAN_NVCC_CCBIN"]]
    return out


def _version(compiler: str) -> str:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True,
                              timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise CudaBuildError(f"{compiler} did not run: {e}") from None


def compile_library(source: str, arch: str, *, defines: tuple[str, ...] = (),
                    nvcc: str | None = None, out_dir: Path | None = None) -> Path:
    """The shared library of ``source`` (a file name in this package, or a path) for ``arch``, with
    ``defines`` (``NAME`` or ``NAME=VALUE``: a kernel's variants): the cached one, or compiled
    now. Raises ``CudaBuildError`` (no nvcc; nvcc failed or timed out)."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise CudaBuildError("no nvcc (set CPPLAN_NVCC or CUDA_HOME, or put nvcc on PATH)")
    return _compile(source, f"sm{arch}", [nvcc, *flags(arch), *(f"-D{d}" for d in defines)],
                    out_dir)


def compile_host(source: str, block: int, *, defines: tuple[str, ...] = (),
                 cxx: str | None = None, out_dir: Path | None = None) -> Path:
    """``source`` built for the host with -DCPPLAN_HOST_EMULATION (``host_emulation.h``: a
    CTA's ``block`` threads as fibers of one OS thread, or as std::threads with
    CPPLAN_HOST_THREADS among ``defines``) by a C++20 compiler (``cxx``, default ``$CXX`` or
    g++), for the CPU tests: unoptimised (-O0), a compile a variant being most of a test's
    time. Raises ``CudaBuildError``."""
    cxx = cxx or os.environ.get("CXX") or shutil.which("g++") or "c++"
    return _compile(source, f"host{block}",
                    [cxx, "-std=c++20", "-O0", "-x", "c++", "-DCPPLAN_HOST_EMULATION",
                     f"-DCPPLAN_ROW_TOPK_BLOCK={block}", *(f"-D{d}" for d in defines),
                     f"-I{HERE}", "-fPIC", "-shared", "-pthread"], out_dir)


def _compile(source: str, tag: str, command: list[str], out_dir: Path | None) -> Path:
    """``command + ["-o", library, source]``, the library named by a hash of the folder's
    sources, the compiler's version and the command; cached."""
    src = HERE / source
    text = b"".join(p.read_bytes() for p in sorted(HERE.glob("*.h"))) + src.read_bytes()
    digest = hashlib.sha256(text + _version(command[0]).encode()
                            + " ".join(command).encode()).hexdigest()
    out_dir = out_dir or cache_dir()
    lib = out_dir / f"{src.stem}-{tag}-{digest[:16]}.so"
    if lib.is_file():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{lib.name}.", suffix=".tmp", dir=out_dir)
    os.close(fd)
    name = os.path.basename(command[0])
    try:
        try:
            res = subprocess.run([*command, "-o", tmp, str(src)], capture_output=True,
                                 text=True, timeout=COMPILE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise CudaBuildError(f"{name} on {source} ran past {COMPILE_TIMEOUT_S} s") from None
        except OSError as e:
            raise CudaBuildError(f"{name} on {source} did not run: {e}") from None
        if res.returncode != 0:
            tail = " | ".join((res.stderr or res.stdout).strip().splitlines()[-3:])
            raise CudaBuildError(f"{name} on {source} failed (exit {res.returncode}): {tail}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def load(path: Path) -> ctypes.CDLL:
    """A library ``compile_library`` / ``compile_host`` made, loaded (callers keep it)."""
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        raise CudaBuildError(f"{path.name} did not load: {e}") from None
