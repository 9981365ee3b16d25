"""C sources of ours compiled at first use with the machine's compiler and kept for the next process.

Two libraries are built this way: the CPU decode-step kernels (:mod:`kvbatch.kernels.cpu.native`)
and the GGUF block multiply (:mod:`kvbatch.kernels.cpu.gguf_kernels`). Each is compiled with
``$CC`` or ``gcc`` (``-O3 -march=native -fopenmp``: about a second), so it is vectorized for the
CPU it runs on (``KVBATCH_NATIVE_MARCH`` names another ``-march``, an older CPU's, to build and run
that one's code paths here), and kept under ``KVBATCH_CACHE_DIR`` named by a hash of the source
and every file of ours it includes (:func:`sources`: ``native.c`` includes ``native_common.h`` and
its ``native_*.c`` parts, compiled as one translation unit into one library), the compiler and its
version, the flags and the CPU's model and flags: a second process, or a second test
worker, only loads it. The build is atomic (a temporary file renamed), so processes building the
same library at once each load a whole file. No compiler, or one that fails: :func:`build`
raises ``RuntimeError`` with the reason, and the caller falls back to its PyTorch path.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from kvbatch.kernels.cpu.machine import cpu_identity, default_cache_dir

CFLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-shared", "-fPIC", "-std=c11")
MARCH_ENV = "KVBATCH_NATIVE_MARCH"


def cflags() -> tuple[str, ...]:
    """The compiler flags of a build: :data:`CFLAGS` with ``-march`` from ``KVBATCH_NATIVE_MARCH``
    where that is set (gcc rejects a name it does not know, and the build fails with its words)."""
    march = os.environ.get(MARCH_ENV, "").strip()
    return tuple(f"-march={march}" if march and f == "-march=native" else f for f in CFLAGS)


def compiler() -> str | None:
    """The C compiler to build with: ``$CC`` when set, else ``gcc`` on the PATH (None: none)."""
    cc = os.environ.get("CC", "").strip() or "gcc"
    return shutil.which(cc)


def compiler_version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


_LOCAL_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)


def sources(source: Path) -> list[Path]:
    """``source`` and every file it includes with ``#include "..."`` (beside the including file),
    transitively, each once, in the order first included: what the compiler reads of ours (the
    native kernels' ``native.c`` includes its parts; a ``<...>`` header is the system's)."""
    found: list[Path] = []

    def visit(path: Path) -> None:
        if path in found:
            return
        found.append(path)
        for name in _LOCAL_INCLUDE.findall(path.read_text()):
            visit((path.parent / name).resolve())

    visit(source.resolve())
    return found


def build_key(source: Path, cc: str) -> str:
    """What a built library depends on: the source and every file of ours it includes (a change to
    any of them rebuilds), the compiler and its flags, the CPU."""
    model, flags = cpu_identity()
    code = [f"{path.name}\n{path.read_text()}" for path in sources(source)]
    text = "\n".join([*code, cc, compiler_version(cc), " ".join(cflags()), model, " ".join(sorted(flags))])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_dir(name: str) -> Path:
    """Where the builds of library ``name`` are kept."""
    return default_cache_dir() / name


def build(source: Path, folder: Path) -> Path:
    """The compiled library of ``source`` in ``folder``, compiling it when the folder lacks it.
    Raises ``RuntimeError`` with the reason (no compiler, compiler errors) when it cannot be had."""
    cc = compiler()
    if cc is None:
        raise RuntimeError(f"no C compiler ({os.environ.get('CC') or 'gcc'} not found on the PATH)")
    target = folder / f"{source.stem}-{build_key(source, cc)}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=target.name, suffix=".tmp")
    os.close(fd)
    try:
        done = subprocess.run([cc, *cflags(), "-o", tmp, str(source), "-lm"], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{Path(cc).name} failed: {' '.join(done.stderr.split())[:300]}")
        os.replace(tmp, target)  # atomic: a concurrent process loads the old file or the new one
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"building {source.name} failed ({type(exc).__name__}: {exc})") from exc
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return target


def load(built: Callable[[], Path], abi_symbol: str, abi: int) -> ctypes.CDLL | str:
    """The library ``built()`` returns, loaded and checked to export ``abi_symbol() == abi``; or,
    when it cannot be had, the reason (a non-empty string) for the caller to fall back on."""
    try:
        path = built()
        lib = ctypes.CDLL(str(path))
    except (RuntimeError, OSError) as exc:
        return str(exc) or type(exc).__name__
    if getattr(lib, abi_symbol)() != abi:
        return f"{path} has another ABI version"
    return lib


def reason(lib: ctypes.CDLL | str) -> str:
    """Why a :func:`load` result is no library ('' when it is one)."""
    return lib if isinstance(lib, str) else ""
