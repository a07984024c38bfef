"""The tensors of an HF checkpoint directory (model.safetensors or a sharded index), as numpy.

Only safetensors are read: pickled (.bin / .pt) checkpoints are refused, never unpickled.
"""

from __future__ import annotations

import json
import os
from typing import Iterator

import numpy as np

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _bf16_fallback(path: str, name: str) -> np.ndarray:
    """safetensors' numpy backend cannot make bfloat16 arrays; read the bytes through ml_dtypes."""
    import ml_dtypes

    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
        info = header[name]
        if info["dtype"] != "BF16":
            raise ValueError(f"tensor {name!r} in {path!r} has unreadable dtype {info['dtype']}")
        start, end = info["data_offsets"]
        f.seek(8 + header_len + start)
        data = f.read(end - start)
    return np.frombuffer(data, dtype=ml_dtypes.bfloat16).reshape(info["shape"])


class SafetensorsDir:
    """Read-only mapping HF tensor name -> numpy array, read lazily from one or more shards."""

    def __init__(self, directory: str | os.PathLike):
        from safetensors import safe_open

        self._safe_open = safe_open
        self.directory = os.fspath(directory)
        single = os.path.join(self.directory, SINGLE_FILE)
        index = os.path.join(self.directory, INDEX_FILE)
        if os.path.isfile(index):
            with open(index) as f:
                try:
                    weight_map = json.load(f)["weight_map"]
                except (json.JSONDecodeError, KeyError) as e:
                    raise ValueError(f"{index!r} is not a safetensors index: {e!r}") from None
            self._file_of = {name: os.path.join(self.directory, file)
                             for name, file in weight_map.items()}
        elif os.path.isfile(single):
            self._file_of = {name: single for name in self._keys(single)}
        else:
            others = sorted(f for f in os.listdir(self.directory)
                            if f.endswith((".bin", ".pt", ".pth", ".safetensors")))
            hint = f" (found {others}; pickled checkpoints are not loaded)" if others else ""
            raise ValueError(
                f"model directory {self.directory!r} has no {SINGLE_FILE} or {INDEX_FILE}{hint}")
        for path in set(self._file_of.values()):
            if not os.path.isfile(path):
                raise ValueError(f"safetensors shard {path!r} listed in the index does not exist")

    def _keys(self, path: str) -> list[str]:
        try:
            with self._safe_open(path, framework="numpy") as f:
                return list(f.keys())
        except Exception as e:  # safetensors raises its own error type on a corrupt header
            raise ValueError(f"{path!r} is not a readable safetensors file: {e}") from e

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __getitem__(self, name: str) -> np.ndarray:
        path = self._file_of[name]
        with self._safe_open(path, framework="numpy") as f:
            try:
                return f.get_tensor(name)
            except TypeError:  # bfloat16
                return _bf16_fallback(path, name)
