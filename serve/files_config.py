"""Where and how much the server's Files and Batches API (/v1/files, /v1/batches) stores, and how
hard its batches push the engine.

The data folder holds the metadata database (SQLite) and every file's bytes, so both outlive the
server; by default it is the user's data folder ($XDG_DATA_HOME/jaxinfer, else
~/.local/share/jaxinfer), as platformdirs would put it on Linux.
"""

from __future__ import annotations

import dataclasses
import os

# Batch lines run after interactive requests when the engine runs the "priority" policy: a lower
# `priority` runs first and interactive requests default to 0.
BATCH_PRIORITY = 100


def default_data_dir() -> str:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local",
                                                            "share")
    return os.path.join(base, "jaxinfer")


@dataclasses.dataclass(frozen=True)
class FilesConfig:
    data_dir: str = dataclasses.field(default_factory=default_data_dir)
    max_stored_bytes: int = 10 * 2**30  # all files together; an upload past it gets 413
    max_active_batches: int = 4  # batches not finished yet; one more gets 429
    max_in_flight: int = 64  # lines of one batch posted at once (the engine's queue stays short)
    batch_priority: int = BATCH_PRIORITY  # used only under scheduling_policy="priority"
    # a batch not done this long after its creation expires: its unanswered lines get error
    # lines (code "batch_expired") and it ends "expired" (the API's completion_window is "24h")
    expiry_s: int = 24 * 3600

    def __post_init__(self):
        for name in ("max_stored_bytes", "max_active_batches", "max_in_flight", "expiry_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
