"""Small native CPU kernels, compiled on first use with the system C++ compiler and cached.

Each kernel file is plain C++ (AVX2 + FMA, OpenMP) built into a shared library with ``g++``
and called through :mod:`ctypes`: no PyTorch headers, no ``ninja``, a few seconds to compile
once per machine (the library lands in ``$BOUNDLESS_CACHE_DIR`` or ``~/.cache/boundless``,
named by a hash of the source and the flags). OpenMP resolves to the ``libgomp`` PyTorch has
already loaded, so the kernels share PyTorch's thread pool rather than starting a second one.

Whatever fails (no compiler, no AVX2, a non-x86 machine, ``BOUNDLESS_NATIVE=0``), ``load``
returns ``None`` and callers keep to their PyTorch path, which computes the same thing.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import mmap
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from boundless.compiled import cache_root

log = logging.getLogger(__name__)

_FLAGS = ["-O3", "-std=c++17", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno"]
_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def enabled() -> bool:
    """Whether native kernels may be used on this machine (``BOUNDLESS_NATIVE=0`` turns them off)."""
    if os.environ.get("BOUNDLESS_NATIVE", "1").lower() in ("0", "false", "no", "off"):
        return False
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    return _cpu_has_avx2_fma()


def _cpu_has_avx2_fma() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return {"avx2", "fma"} <= flags
    except OSError:
        pass
    return False


def _cache_dir() -> Path:
    return cache_root() / "native"


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _local_headers(source: Path) -> list[Path]:
    """The headers ``source`` includes by a quoted path (ours, beside it), so that editing one
    rebuilds the library."""
    names = re.findall(r'^\s*#include\s+"([^"]+)"', source.read_text(), flags=re.MULTILINE)
    return [(source.parent / n).resolve() for n in names]


def _build(source: Path, name: str) -> Path:
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++) on PATH")
    text = source.read_bytes() + b"".join(h.read_bytes() for h in _local_headers(source))
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(text + " ".join(_FLAGS).encode() + version.encode()).hexdigest()[:16]
    out_dir = _cache_dir()
    target = out_dir / f"{name}-{key}.so"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    # Compile beside the target and rename: concurrent processes never load a half-written file.
    fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        result = subprocess.run([cxx, *_FLAGS, str(source), "-o", tmp], capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"compiling {source.name} failed:\n{result.stderr[-4000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load(name: str, source: Path, signatures: dict[str, tuple[object, list[object]]]) -> ctypes.CDLL | None:
    """The library built from ``source`` with ``signatures`` (function: (restype, argtypes)) set,
    or ``None`` when native kernels are off or unavailable here. Built once per process."""
    with _lock:
        if name in _loaded:
            return _loaded[name]
        lib = None
        if enabled():
            torch.get_num_threads()  # PyTorch's libgomp is loaded first, so the library binds to it
            try:
                lib = ctypes.CDLL(str(_build(source, name)))
                for fn, (restype, argtypes) in signatures.items():
                    f = getattr(lib, fn)
                    f.restype = restype
                    f.argtypes = argtypes
            except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
                log.warning("native kernels %s unavailable, using the PyTorch path: %s", name, e)
                lib = None
        _loaded[name] = lib
        return lib


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def huge_page_empty(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialized 1-D CPU tensor on 2 MiB-aligned memory that Linux is asked to back with
    transparent huge pages (``madvise``), for large arrays read in a scattered or streaming way
    (packed weights, the KV pool): fewer TLB misses. Elsewhere it is a plain ``torch.empty``."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if platform.system() != "Linux" or nbytes < _HUGE_PAGE:
        return torch.empty(numel, dtype=dtype)
    return _huge_page_view(torch.empty(nbytes + 2 * _HUGE_PAGE, dtype=torch.uint8), nbytes, dtype)


def huge_page_zeros(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A zeroed 1-D CPU tensor on 2 MiB-aligned memory with the huge-page hint (as :func:`huge_page_empty`), from an
    anonymous mapping: the kernel zeroes each page when it is first touched, so a large pool costs neither time nor
    resident memory until it is used (``zero_`` of the default 2 GiB KV pool took 1.5 s of start-up)."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if platform.system() != "Linux" or nbytes < _HUGE_PAGE:
        return torch.zeros(numel, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes + 2 * _HUGE_PAGE)  # (virtual only until touched; the tensor keeps it alive)
    return _huge_page_view(torch.frombuffer(mapping, dtype=torch.uint8), nbytes, dtype)


def _huge_page_view(raw: torch.Tensor, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    """``nbytes`` of ``raw`` (bytes, 4 MiB more than that: room for the hint's whole pages) from its first 2 MiB
    boundary, as ``dtype``, with Linux asked to back them with huge pages."""
    start = -raw.data_ptr() % _HUGE_PAGE
    length = -(-nbytes // _HUGE_PAGE) * _HUGE_PAGE
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise(raw.data_ptr() + start, length, _MADV_HUGEPAGE)  # a hint: failure changes nothing
    except (OSError, AttributeError):
        pass
    return raw[start : start + nbytes].view(dtype)


def threads() -> int:
    return torch.get_num_threads()


P = ctypes.c_void_p
L = ctypes.c_long
I = ctypes.c_int  # noqa: E741
F = ctypes.c_float
