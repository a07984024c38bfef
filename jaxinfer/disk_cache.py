"""On-disk caches of slow start-up work (converted weights, converted tokenizers): where they live,
how an entry is keyed, and how it is published atomically. No JAX here.

Layout: `<root>/<kind>/<slot>/<key>/...` where `slot` names the source (a hash of its path) and
`key` its identity (size, mtime, inode of each source file) plus the code version (a hash of the
modules that produce the entry, the versions of the libraries they use). One entry per slot: a new
one replaces the old, so editing the code or the model does not pile up stale copies.

    JAXINFER_CACHE_DIR   root (default: $XDG_CACHE_HOME/jaxinfer, else ~/.cache/jaxinfer)
    JAXINFER_NO_CACHE=1  read and write none of these caches (the JAX compilation cache is apart)

An entry is a directory written under a temporary name and renamed into place, so a reader sees
a whole entry or none. A reader that finds an unreadable entry deletes it and rebuilds (callers
log a warning).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

CACHE_DIR_ENV = "JAXINFER_CACHE_DIR"
NO_CACHE_ENV = "JAXINFER_NO_CACHE"
_ABANDONED_SECONDS = 3600.0  # a temporary entry older than this was left by a crashed writer


def cache_root() -> Path:
    root = os.environ.get(CACHE_DIR_ENV)
    if root:
        return Path(root).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jaxinfer"


def cache_enabled() -> bool:
    return os.environ.get(NO_CACHE_ENV, "").strip().lower() in ("", "0", "false", "no")


def file_identity(path: str | os.PathLike) -> list:
    """[real path, size, mtime_ns, inode]: changes when the file is rewritten or replaced."""
    real = os.path.realpath(path)
    st = os.stat(real)
    return [real, st.st_size, st.st_mtime_ns, st.st_ino]


def code_version(module_files: Iterable[str | os.PathLike], packages: Sequence[str] = ()) -> list:
    """A hash of the given source files' bytes plus the installed versions of `packages`."""
    h = hashlib.sha256()
    for path in module_files:
        with open(path, "rb") as f:
            data = f.read()
        h.update(len(data).to_bytes(8, "little"))  # bytes moved between two files: another hash
        h.update(data)
    versions = []
    for name in packages:
        try:
            versions.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{name} missing")
    return [h.hexdigest()[:16], versions]


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:32]


class CacheSlot:
    """The cache of one source (`slot_id`, e.g. its path) for one `kind` of entry."""

    def __init__(self, kind: str, slot_id, key, root: str | os.PathLike | None = None):
        self.dir = Path(root if root is not None else cache_root()) / kind / _digest(slot_id)
        self.key = _digest(key)
        self.entry = self.dir / self.key

    def lookup(self) -> Path | None:
        """The entry's directory if it was published, else None."""
        return self.entry if self.entry.is_dir() else None

    def discard(self) -> None:
        """Deletes this entry (an unreadable one)."""
        shutil.rmtree(self.entry, ignore_errors=True)

    def publish(self, write) -> Path:
        """`write(tmp_dir)` fills a fresh directory, which then becomes the entry (atomic rename;
        if another process published the same entry first, theirs is kept). Older entries of the
        slot are deleted. Raises what `write` raises, leaving nothing behind."""
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{self.key}.", dir=self.dir))
        try:
            write(tmp)
            try:
                os.rename(tmp, self.entry)
            except OSError:  # published meanwhile by another process
                if not self.entry.is_dir():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        now = time.time()
        for other in self.dir.iterdir():
            if other.name == self.key:
                continue
            # a dot name is another writer's temporary directory: left alone unless abandoned
            if not other.name.startswith(".") or now - other.stat().st_mtime > _ABANDONED_SECONDS:
                shutil.rmtree(other, ignore_errors=True)
        return self.entry
