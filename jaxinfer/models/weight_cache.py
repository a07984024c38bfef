"""A disk cache of converted weights: (ModelConfig, the param dict of `weights.params_from_hf`).

Reading a GGUF file (its metadata holds the whole vocabulary: ~100k strings parsed one at a time by
the `gguf` reader), dequantizing it and fusing/transposing/stacking the tensors costs seconds on
every start; the result, stored as .npy files, maps back into memory in milliseconds. The entry
is keyed by the source file's identity (path, size, mtime, inode), the param dtype and the code
that shapes it (CODE_MODULES: what reads and converts the file, the ModelConfig stored with the
params, the model whose param tree they fill; the versions of the packages that dequantize and
cast): see `jaxinfer.disk_cache`. Quantized loads are not part of an entry (they take their blocks
from the file on every load), so the quant modules are not in the key. No JAX here.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np

from jaxinfer import disk_cache
from jaxinfer.config import ModelConfig

logger = logging.getLogger(__name__)

KIND = "weights"
FORMAT_VERSION = 1  # bump when the entry's layout changes
# Smaller source files convert in well under a second: not worth a copy on disk (and the tests'
# tiny checkpoints leave nothing in the user's cache).
MIN_SOURCE_BYTES = 16 * 2**20
_INDEX_FILE = "index.json"
_SEP = "/"
# Sources (relative to the jaxinfer package) whose code shapes an entry: a change to any of them
# is a new key. Every jaxinfer module that the first three import is here too (a test checks).
CODE_MODULES = (
    "models/weight_cache.py",  # the entry's files and index
    "models/weights.py",  # HF tensors -> the fused, transposed, stacked param tree
    "models/gguf_file.py",  # GGUF names, Q/K un-permutation, dequantization, the ModelConfig read
    "models/loader.py",  # what is converted and stored, in which dtype
    "models/llama.py",  # the param tree an entry must fill
    "models/layers.py",  # ... down to each parameter's name and shape
    "config.py",  # ModelConfig, stored in the index (to_dict / from_dict)
    "disk_cache.py",  # keys and publication
)
CODE_PACKAGES = ("gguf", "numpy", "ml_dtypes")  # gguf dequantizes; numpy / ml_dtypes cast
# dtypes .npy files store as such; others (bfloat16) go as same-width unsigned ints
_NATIVE = {"float32", "float16", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16",
           "uint32", "uint64", "bool"}
_VIEW_AS = {2: np.uint16, 4: np.uint32, 1: np.uint8}


def code_files() -> list[Path]:
    """The source files of CODE_MODULES."""
    package = Path(__file__).resolve().parents[1]
    return [package / m for m in CODE_MODULES]


def weight_slot(source_files: list[str], dtype, root: str | os.PathLike | None = None):
    """The CacheSlot of a model made from `source_files` in param `dtype`."""
    key = {
        "format": FORMAT_VERSION,
        "sources": [disk_cache.file_identity(f) for f in source_files],
        "dtype": np.dtype(dtype).name,
        "code": disk_cache.code_version(code_files(), CODE_PACKAGES),
    }
    slot_id = [os.path.realpath(f) for f in source_files]
    return disk_cache.CacheSlot(KIND, slot_id, key, root)


# -- nested param dict <-> flat safetensors --------------------------------------------------------
def _flatten(tree: dict, prefix: str = "") -> dict[str, np.ndarray]:
    flat = {}
    for name, value in tree.items():
        if _SEP in str(name):
            raise ValueError(f"param name {name!r} must not contain {_SEP!r}")
        key = f"{prefix}{name}"
        if isinstance(value, dict):
            flat.update(_flatten(value, key + _SEP))
        else:
            flat[key] = value
    return flat


def _unflatten(flat: dict[str, np.ndarray]) -> dict:
    tree: dict = {}
    for key, value in flat.items():
        *parents, leaf = key.split(_SEP)
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def _file_name(key: str) -> str:
    return key.replace(_SEP, ".") + ".npy"


def save(slot: disk_cache.CacheSlot, config: ModelConfig, params: dict) -> Path:
    """Publishes (config, params) as the slot's entry: one .npy file per tensor plus an index."""
    flat = _flatten(params)
    index = {}
    for key, array in flat.items():
        dtype = np.dtype(array.dtype)
        index[key] = {"file": _file_name(key), "dtype": dtype.name, "shape": list(array.shape)}

    def write(tmp: Path) -> None:
        for key, array in flat.items():
            array = np.ascontiguousarray(array)
            if array.dtype.name not in _NATIVE:  # .npy has no bfloat16: store the bits
                array = array.view(_VIEW_AS[array.dtype.itemsize])
            np.save(tmp / index[key]["file"], array, allow_pickle=False)
        with open(tmp / _INDEX_FILE, "w") as f:
            json.dump({"model_config": config.to_dict(), "params": index}, f)

    return slot.publish(write)


def load(slot: disk_cache.CacheSlot) -> tuple[ModelConfig, dict] | None:
    """(config, params) from the slot's entry; None if there is none. The arrays are read-only
    memory maps of the entry's files (`jax.device_put` of one on the CPU aliases it: no copy;
    entries are only ever replaced by rename or deleted, never rewritten in place, so a mapping
    stays valid). An unreadable entry is deleted (with a warning) and None returned, so the caller
    rebuilds it."""
    entry = slot.lookup()
    if entry is None:
        return None
    try:
        with open(entry / _INDEX_FILE) as f:
            meta = json.load(f)
        config = ModelConfig.from_dict(meta["model_config"])
        flat = {}
        for key, info in meta["params"].items():
            array = np.load(entry / info["file"], mmap_mode="r", allow_pickle=False)
            dtype = _dtype(info["dtype"])
            if array.dtype != dtype:
                array = array.view(dtype)
            if list(array.shape) != info["shape"]:
                raise ValueError(f"{key}: shape {array.shape}, index says {info['shape']}")
            flat[key] = array
        return config, _unflatten(flat)
    except Exception as e:  # noqa: BLE001 - any damage means: rebuild from the source
        logger.warning("weight cache entry %s is unreadable (%s: %s); rebuilding it", entry,
                       type(e).__name__, e)
        slot.discard()
        return None


def _dtype(name: str) -> np.dtype:
    if name in _NATIVE:
        return np.dtype(name)
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, name))
