"""Compiled steps saved to disk and loaded back without tracing.

JAX's persistent compilation cache skips XLA's compile, but its key is a hash of the lowered
program, so every start still traces and lowers every shape bucket. This cache keys a serialized
executable (`jax.experimental.serialize_executable`) by what determines the program instead:

  * the code: a hash of every .py file of `jaxinfer` and `pallas_kernels`, and the versions of
    jax, jaxlib, flax, numpy, ml_dtypes and any PJRT plugin;
  * the platform: backend, platform version, device kind and count, process count;
  * JAX's configuration values and XLA_FLAGS;
  * the step: the model's graph definition, the model and engine configs, the static arguments
    (packed layout, flags), and every argument's shape, dtype and sharding.

A mismatch anywhere is a miss, never a wrong hit; a loaded executable still checks its arguments'
types on every call. An XLA:CPU step that JAX restored from its own persistent cache, serialized
again here, comes back unable to run ("Function ... not found"); the server therefore keeps JAX's
cache off (serve/cli.py) so this cache only gets freshly compiled steps, and warm-up runs every
executable once and compiles a failing one again past both caches, saving it over its entry
(`ModelRunner.check_executables`), which repairs entries written before. It lives in
`<jax_compilation_cache_dir>/jaxinfer-executables`, only while that directory is set and JAX's
own cache is off; JAXINFER_NO_CACHE=1 turns it off. Loading one unpickles a file
from that directory: like JAX's own cache (which loads machine code from it), the directory must be
the user's own.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import shutil
import tempfile
import threading
from pathlib import Path

import jax

from jaxinfer import disk_cache

logger = logging.getLogger(__name__)

SUBDIR = "jaxinfer-executables"
FORMAT_VERSION = 1
_KEEP_FINGERPRINTS = 8  # directories of other code versions kept (most recently used first)
_PACKAGES = ("jax", "jaxlib", "flax", "numpy", "ml_dtypes", "jax-cuda12-plugin", "jax-cuda12-pjrt",
             "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-rocm7-plugin", "jax-rocm7-pjrt",
             "libtpu")
_CONFIG_NOISE = ("compilation_cache", "persistent_cache", "log", "traceback", "dump", "pprint",
                 "explain_cache_misses")
_ENV = ("XLA_FLAGS", "LIBTPU_INIT_ARGS", "NVIDIA_TF32_OVERRIDE")


def _source_files() -> list[Path]:
    """The code a compiled step depends on: the Python that traces it, and the CPU kernels' sources
    (their custom calls' operands and attributes are fixed when the step is lowered)."""
    root = Path(__file__).resolve().parents[2]
    return sorted(p for pkg in ("jaxinfer", "pallas_kernels", "cpu_kernels")
                  for pattern in ("*.py", "*.cc", "*.h") for p in (root / pkg).rglob(pattern))


def environment_fingerprint() -> str:
    """A hash of the code, library versions, platform and JAX configuration."""
    devices = jax.devices()
    values = getattr(jax.config, "values", None)
    if not isinstance(values, dict):  # the key then has no config: refuse rather than guess
        raise RuntimeError("jax.config.values is not available")
    config = {k: repr(v) for k, v in values.items() if not any(n in k for n in _CONFIG_NOISE)}
    parts = {
        "format": FORMAT_VERSION,
        "code": disk_cache.code_version(_source_files(), _PACKAGES),
        "platform": [jax.default_backend(), devices[0].client.platform_version,
                     devices[0].device_kind, len(devices), jax.process_count()],
        "config": config,
        "env": {k: os.environ.get(k) for k in _ENV},
    }
    return _hash(repr(sorted(parts.items())))


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _describe(x) -> str:
    if isinstance(x, jax.Array):
        return f"{x.shape}{x.dtype}{x.weak_type}{x.sharding}"
    if hasattr(x, "shape") and hasattr(x, "dtype"):  # numpy
        return f"{x.shape}{x.dtype}np"
    return repr(type(x))


class ExecutableCache:
    """Serialized `jax.stages.Compiled` steps under `directory/<environment fingerprint>/`."""

    def __init__(self, directory: str | os.PathLike, fingerprint: str | None = None):
        self.root = Path(directory)
        self.dir = self.root / (fingerprint or environment_fingerprint())
        # One (de)serialization at a time: warm-up prepares buckets on several threads, and two
        # concurrent `deserialize_and_load` calls can crash the process (a segfault in jaxlib).
        self._load_lock = threading.Lock()

    @classmethod
    def from_jax_config(cls) -> "ExecutableCache | None":
        """Under jax_compilation_cache_dir when that is set and JAX's own cache is off (as the
        server sets them: the two caches must not feed each other, module docstring); else None."""
        jax_dir = getattr(jax.config, "jax_compilation_cache_dir", None)
        if not jax_dir or not disk_cache.cache_enabled():
            return None
        if getattr(jax.config, "jax_enable_compilation_cache", True):
            return None
        try:
            return cls(Path(jax_dir) / SUBDIR)
        except Exception as e:  # noqa: BLE001 - e.g. another JAX without config.values
            logger.warning("executable cache off: %s", e)
            return None

    @staticmethod
    def step_key(static: tuple, args: tuple, context: str) -> str:
        """The key of one step: its static arguments, its arguments' types and shardings, and
        `context` (the graph definition, configs)."""
        leaves, treedef = jax.tree.flatten(args)
        return _hash(repr((static, str(treedef), [_describe(x) for x in leaves], context)))

    def _path(self, key: str) -> Path:
        return self.dir / f"{key}.jaxexe"

    def load(self, key: str, args: tuple):
        """The Compiled step for `key`, or None (missing, unreadable, or made for other args)."""
        path = self._path(key)
        if not path.is_file():
            return None
        try:
            from jax.experimental.serialize_executable import deserialize_and_load

            with open(path, "rb") as f:
                serialized, in_tree, out_tree = pickle.load(f)
            if in_tree != jax.tree.structure((args, {})):
                raise ValueError("argument structure differs")
            with self._load_lock:
                compiled = deserialize_and_load(serialized, in_tree, out_tree)
            os.utime(self.dir)  # recently used: kept by the pruning in save()
            return compiled
        except Exception as e:  # noqa: BLE001 - damaged or incompatible: compile afresh
            logger.warning("executable cache entry %s is unusable (%s: %s); compiling", path,
                           type(e).__name__, e)
            path.unlink(missing_ok=True)
            return None

    def save(self, key: str, compiled) -> None:
        """Writes the Compiled step (atomically); a failure only logs a warning."""
        try:
            from jax.experimental.serialize_executable import serialize

            with self._load_lock:  # (de)serialization one at a time, as in load()
                blob = pickle.dumps(serialize(compiled), protocol=pickle.HIGHEST_PROTOCOL)
            new_dir = not self.dir.is_dir()
            self.dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".", dir=self.dir)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(blob)
                os.replace(tmp, self._path(key))
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            if new_dir:
                self._prune()
        except Exception as e:  # noqa: BLE001 - serving works without it
            logger.warning("cannot save the compiled step to %s: %s: %s", self.dir,
                           type(e).__name__, e)

    def _prune(self) -> None:
        """Keeps the _KEEP_FINGERPRINTS most recently used fingerprint directories."""
        dirs = sorted((d for d in self.root.iterdir() if d.is_dir()),
                      key=lambda d: d.stat().st_mtime, reverse=True)
        for d in dirs[_KEEP_FINGERPRINTS:]:
            shutil.rmtree(d, ignore_errors=True)
