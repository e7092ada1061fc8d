"""Compiles linear.c, layer.c, block.c and threads.c for this machine once, into one library, and loads it with ctypes.

The library is built with the system's C compiler (`$CC`, else `cc`) for the CPU it runs on
(`-march=native`; `$LLAMA_CORE_CPU_TARGET` names another target, e.g. `haswell`) and kept in a cache
directory (`$LLAMA_CORE_CACHE`, else `~/.cache/llama_core`) under a name that hashes the source, the
compiler, its flags and the CPU's features, so an upgrade or another machine builds afresh. The kernels are
written for x86's AVX-512 and AVX2 (with FMA); a target with neither gets torch's products. It links against
the OpenMP runtime torch has already loaded (GNU libgomp in torch's builds), so the two share one pool of
threads. A build (a first start, a few seconds) says so in one line, logged (on stderr unless an application set
logging up otherwise; `llama-generate -q` silences it); a load from the cache says nothing.
Where nothing can be built (no compiler), `load` returns None and the caller keeps torch's own products.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Optional

SOURCES = tuple(Path(__file__).with_name(name) for name in ("linear.c", "layer.c", "block.c", "threads.c"))
HEADERS = (Path(__file__).with_name("widen.h"),)
FLAGS = ("-O3", "-ffp-contract=fast", "-Wno-psabi", "-shared", "-fPIC")
DISABLE_VARIABLE = "LLAMA_CORE_CPU_KERNELS"  # "0" keeps torch's own CPU products
TARGET_VARIABLE = "LLAMA_CORE_CPU_TARGET"  # what -march gets: "native" unless set

# Logged at WARNING, the least that Python shows with no logging set up (its last-resort handler writes the bare
# message to stderr), so a first start says why it waits; a command line raises the "llama_core" logger's level
log = logging.getLogger(__name__)
_lock = threading.Lock()
_loaded: dict[tuple[str, str], Optional[ctypes.CDLL]] = {}  # (compiler, target): its library, or None


def enabled() -> bool:
    """False when the environment turns the kernels off (LLAMA_CORE_CPU_KERNELS=0)."""
    return os.environ.get(DISABLE_VARIABLE, "1").strip().lower() not in ("0", "false", "no", "off")


def target() -> str:
    """The CPU the kernels are compiled for (GCC's -march): this machine's unless LLAMA_CORE_CPU_TARGET says."""
    return os.environ.get(TARGET_VARIABLE, "").strip() or "native"


def _build_key() -> tuple[str, str]:
    """The compiler and target the environment asks for: what a library is built and kept for."""
    return os.environ.get("CC") or "cc", target()


def describe() -> Optional[str]:
    """What the CPU's products run on, in words, e.g. "llama_core's kernels (AVX2, built for native)"; None where
    the kernels are not used (see load)."""
    library = load()
    if library is None:
        return None
    return f"llama_core's kernels ({library.vector_instructions().decode()}, built for {target()})"


def cache_dir() -> Path:
    root = os.environ.get("LLAMA_CORE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "llama_core")
    return Path(root) / "kernels"


def _cache_dirs() -> list[Path]:
    """Where the library is kept: the cache directory, and a per-user temporary one for when the cache
    cannot be written (a read-only home)."""
    return [cache_dir(), Path(tempfile.gettempdir()) / f"llama_core-kernels-{os.getuid() if hasattr(os, 'getuid') else 'user'}"]


def expected() -> bool:
    """Whether load() gives the kernels (or would, on its first call), without building them: turned on, a C
    compiler, and a target with AVX-512 or AVX2 and FMA (asked of the compiler's preprocessor). A process that
    will not run the model asks this rather than build them."""
    if not enabled():
        return False
    key = _build_key()
    if key in _loaded:
        return _loaded[key] is not None
    return shutil.which(key[0]) is not None and _target_has_vectors(*key)


_VECTOR_MACROS = ("__AVX512F__", "__AVX2__ __FMA__")  # either suffices: linear.c's native_vectors


@functools.lru_cache(maxsize=None)
def _target_has_vectors(compiler: str, target_name: str) -> bool:
    macros = set((_run([compiler, f"-march={target_name}", "-dM", "-E", "-x", "c", os.devnull]) or "").split())
    return any(all(name in macros for name in wanted.split()) for wanted in _VECTOR_MACROS)


def load() -> Optional[ctypes.CDLL]:
    """The compiled kernels (built on first call), or None where they are turned off, cannot be built, or the
    target lacks the AVX-512 or AVX2 they are written for (one warning says why)."""
    if not enabled():
        return None
    key = _build_key()
    if key in _loaded:  # every product asks: no lock once built
        return _loaded[key]
    with _lock:
        if key not in _loaded:
            _loaded[key] = _build_and_load(*key)
        return _loaded[key]


def _build_and_load(compiler: str, target_name: str) -> Optional[ctypes.CDLL]:
    import torch  # noqa: F401  (its OpenMP runtime must be loaded before ours resolves to it)

    if shutil.which(compiler) is None:
        warnings.warn(f"llama_core: no C compiler ({compiler!r}) found, so CPU products use torch's kernels, "
                      f"which are slower at a few rows; install gcc (or set CC) for the faster ones", stacklevel=3)
        return None
    source = b"\0".join(path.read_bytes() for path in SOURCES + HEADERS)
    version = _run([compiler, "--version"]) or ""
    last_error, announced = "", False
    for openmp in (("-fopenmp",), ()):  # without OpenMP (e.g. Apple's clang) the product runs on one thread
        flags = FLAGS + (f"-march={target_name}",) + openmp
        key = hashlib.sha256(b"\0".join([source, version.encode(), " ".join(flags).encode(),
                                         platform.machine().encode(), _cpu_features().encode()])).hexdigest()[:16]
        target, last_error = next((d / f"kernels-{key}.so" for d in _cache_dirs() if (d / f"kernels-{key}.so").exists()), None), ""
        if target is None and not announced:  # the seconds a first start spends here, said once
            log.warning("llama_core: compiling its CPU kernels for this machine (once; kept in %s)", _cache_dirs()[0])
            announced = True
        for directory in ([] if target else _cache_dirs()):  # the cache, else a temporary directory
            target = directory / f"kernels-{key}.so"
            last_error = _compile(compiler, flags, target)
            if not last_error:
                break
        if last_error:
            continue
        try:
            library = ctypes.CDLL(str(target))
        except OSError as error:
            last_error = str(error)
            continue
        _declare(library)
        if not library.native_vectors():
            warnings.warn(f"llama_core: the CPU target {target_name!r} has neither AVX-512 nor AVX2 with FMA, which "
                          "llama_core's CPU kernels are written for (without them they run many times slower than "
                          "torch's), so CPU products use torch's kernels", stacklevel=3)
            return None
        return library
    warnings.warn(f"llama_core: could not build the CPU kernels with {compiler!r}, so CPU products use torch's "
                  f"kernels: {last_error.strip()[:500]}", stacklevel=3)
    return None


def _compile(compiler: str, flags: tuple[str, ...], target: Path) -> str:
    """Builds target; returns the compiler's error ('' on success). Written to a temporary name and
    renamed, so processes building at once never load a half-written file."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        descriptor, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(descriptor)
    except OSError as error:
        return f"cannot write to {target.parent}: {error}"
    try:
        result = subprocess.run([compiler, *flags, *map(str, SOURCES), "-o", partial], capture_output=True, text=True,
                                timeout=120)
        if result.returncode != 0:
            return result.stderr or f"{compiler} exited {result.returncode}"
        os.replace(partial, target)
        return ""
    except (OSError, subprocess.SubprocessError) as error:
        return str(error)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def _declare(library: ctypes.CDLL) -> None:
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    for name in ("panel_linear_f32", "panel_linear_bf16", "panel_linear_f16"):
        getattr(library, name).argtypes = [pointer, pointer, pointer, pointer, size, size, size, ctypes.c_int]
        getattr(library, name).restype = None
    library.panel_linear_i8.argtypes = [pointer, pointer, pointer, pointer, pointer, size, size, size, ctypes.c_int]
    library.panel_linear_i8.restype = ctypes.c_int
    library.panel_linear_i4.argtypes = [pointer, pointer, pointer, pointer, size, size, size, ctypes.c_int]
    library.panel_linear_i4.restype = ctypes.c_int
    library.panel_width.restype = ctypes.c_int
    library.tile_rows.restype = ctypes.c_int
    library.int_tile_rows.restype = ctypes.c_int
    library.native_vectors.restype = ctypes.c_int
    library.vector_instructions.restype = ctypes.c_char_p
    library.rms_norm.argtypes = [pointer, pointer, pointer, size, size, ctypes.c_float, ctypes.c_int]
    library.rms_norm.restype = None
    library.silu_mul.argtypes = [pointer, pointer, size, size, ctypes.c_int]
    library.silu_mul.restype = None
    library.attend_new_tokens.argtypes = [pointer, size, pointer, ctypes.c_int, pointer, pointer, pointer, pointer, size,
                                          size, size, size, size, size, pointer, ctypes.c_int]
    library.attend_new_tokens.restype = ctypes.c_int
    library.decoder_block.argtypes = [pointer, size, size, ctypes.c_float, pointer, ctypes.c_int, pointer, pointer, pointer,
                                      pointer, size, pointer, ctypes.c_int, pointer, pointer, pointer, pointer, size,
                                      size, size, size, size, ctypes.c_int]
    library.decoder_block.restype = ctypes.c_int
    library.argmax_rows.argtypes = [pointer, size, size, pointer]
    library.argmax_rows.restype = None
    library.release_openmp_workers.argtypes = []
    library.release_openmp_workers.restype = ctypes.c_int


def _run(command: list[str]) -> Optional[str]:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def _cpu_features() -> str:
    """What -march=native depends on: the CPU's feature flags (Linux), else the processor's name."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()
