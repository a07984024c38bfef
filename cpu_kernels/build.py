"""Compiling and loading the C++ CPU kernels (XLA FFI custom calls) on first use.

Each kernel is one C++ file beside this module. `load(name)` compiles it once with the system's
C++ compiler against the XLA FFI headers that jaxlib ships, for this machine's CPU
(`-march=native`), into a cache directory keyed by everything that shapes the binary (source,
compiler, jaxlib, CPU flags); registers its handler with JAX; and returns the target name, or
None when it cannot be built here (no compiler, a compile error): the callers then run the XLA
path instead. The cache is `$JAXINFER_CACHE_DIR/cpu_kernels`, else `$XDG_CACHE_HOME/jaxinfer/
cpu_kernels` or `~/.cache/jaxinfer/cpu_kernels`; `JAXINFER_CPU_KERNELS=0` turns the kernels off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jaxlib

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent
CXX_FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-ffp-contract=fast", "-shared", "-fPIC",
             "-std=c++17", "-Wno-attributes", "-Wno-return-type")


def cache_dir() -> Path:
    root = os.environ.get("JAXINFER_CACHE_DIR")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "jaxinfer")
    return Path(root) / "cpu_kernels"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def cpu_flags() -> str:
    """This CPU's feature flags (/proc/cpuinfo), which -march=native compiles for."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return os.uname().machine


def _binary_key(source: bytes, compiler: str) -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    h = hashlib.sha256()
    headers = [path.read_bytes() for path in sorted(SOURCE_DIR.glob("*.h"))]  # included by all
    for part in (source, *headers, version.encode(), jaxlib.__version__.encode(),
                 cpu_flags().encode(), " ".join(CXX_FLAGS).encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:24]


def _compile(source_path: Path, out: Path, compiler: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        cmd = [compiler, *CXX_FLAGS, f"-I{jax.ffi.include_dir()}", f"-I{SOURCE_DIR}",
               str(source_path), "-o", str(tmp_out)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr[-4000:]}")
        os.replace(tmp_out, out)  # atomic: a concurrent loader sees the whole file or none


def _build_and_register(source_path: Path, lib_stem: str, target: str, symbol: str,
                        compiler: str) -> str:
    """Compiles `source_path` into the cache (unless there) and registers handler `symbol` as
    `target`; raises OSError / RuntimeError / AttributeError where it cannot."""
    source = source_path.read_bytes() + b"".join(  # the shared headers shape the binary too
        h.read_bytes() for h in sorted(SOURCE_DIR.glob("*.h")))
    lib_path = cache_dir() / f"{lib_stem}-{_binary_key(source, compiler)}.so"
    if not lib_path.is_file():
        logger.info("compiling the CPU kernel %s -> %s", source_path.name, lib_path)
        _compile(source_path, lib_path, compiler)
    lib = ctypes.cdll.LoadLibrary(str(lib_path))
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return target


@functools.cache
def load(name: str, symbol: str) -> str | None:
    """The FFI target name of kernel `name` (`name`.cc, handler `symbol`), registered for the
    CPU; None when the kernels are off or cannot be built on this machine."""
    if os.environ.get("JAXINFER_CPU_KERNELS", "1") == "0" or jax.default_backend() != "cpu":
        return None
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C++ compiler found: the CPU kernel %s is off (XLA path instead)", name)
        return None
    try:
        return _build_and_register(SOURCE_DIR / f"{name}.cc", name, f"{name}.{symbol}", symbol,
                                   compiler)
    except (OSError, RuntimeError, AttributeError) as e:
        logger.warning("the CPU kernel %s is off (XLA path instead): %s", name, e)
        return None


def load_variant(source: Path, name: str, symbol: str, tag: str) -> str:
    """Another version of kernel `name`'s source (a benchmark's `--against`), compiled as `load`
    compiles and registered as its own target, `name_tag.symbol`; raises where it cannot be."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler found")
    return _build_and_register(source, f"{name}-{tag}", f"{name}_{tag}.{symbol}", symbol,
                               compiler)
