"""The Files and Batches API's storage: objects in SQLite (WAL mode), file bytes on disk.

    store = Store("/data/jaxinfer")   # creates the folder, jaxinfer.db and files/
    store.add_file(file_object, source_path)   # moves the bytes in, then records the object

Files and batches are kept as OpenAI's JSON objects (serve/batch_objects.py), one row each, so a
restarted server answers exactly as before. A file's bytes are written to a temporary name,
fsynced and renamed before its row is committed, so a row never points at a partial file; temporary
files left by a kill are removed when the store opens. The store is used from the server's event
loop only, but a lock makes it safe from any thread.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")  # batch statuses not final


class Store:
    def __init__(self, data_dir: str):
        self.data_dir = data_dir
        self.files_dir = os.path.join(data_dir, "files")
        self.runs_dir = os.path.join(data_dir, "batches")
        for d in (self.files_dir, self.runs_dir):
            os.makedirs(d, exist_ok=True)
        for name in os.listdir(self.files_dir):
            if name.endswith(".tmp"):
                os.unlink(os.path.join(self.files_dir, name))
        self._lock = threading.Lock()
        self._db = sqlite3.connect(os.path.join(data_dir, "jaxinfer.db"), isolation_level=None,
                                   check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("CREATE TABLE IF NOT EXISTS files (id TEXT PRIMARY KEY, "
                         "created_at INTEGER, bytes INTEGER, obj TEXT)")
        self._db.execute("CREATE TABLE IF NOT EXISTS batches (id TEXT PRIMARY KEY, "
                         "created_at INTEGER, status TEXT, obj TEXT)")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- files ---------------------------------------------------------------------------------

    def file_path(self, file_id: str) -> str:
        return os.path.join(self.files_dir, file_id)

    def temp_path(self, file_id: str) -> str:
        return self.file_path(file_id) + ".tmp"

    def add_file(self, obj: dict, temp_path: str) -> None:
        """Makes the written, closed `temp_path` the bytes of `obj` (replacing a file of the same
        id) and records `obj`."""
        with open(temp_path, "rb") as f:
            os.fsync(f.fileno())
        os.replace(temp_path, self.file_path(obj["id"]))
        sync_dir(self.files_dir)
        with self._lock:
            self._db.execute("INSERT INTO files VALUES (?, ?, ?, ?) ON CONFLICT(id) DO UPDATE SET "
                             "created_at = excluded.created_at, bytes = excluded.bytes, "
                             "obj = excluded.obj",
                             (obj["id"], obj["created_at"], obj["bytes"], json.dumps(obj)))

    def get_file(self, file_id: str) -> dict | None:
        return self._one("SELECT obj FROM files WHERE id = ?", (file_id,))

    def list_files(self) -> list[dict]:
        return self._all("SELECT obj FROM files ORDER BY created_at DESC, rowid DESC", ())

    def delete_file(self, file_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM files WHERE id = ?", (file_id,))
        try:
            os.unlink(self.file_path(file_id))
        except FileNotFoundError:
            pass

    def stored_bytes(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COALESCE(SUM(bytes), 0) FROM files").fetchone()[0]

    # -- batches -------------------------------------------------------------------------------

    def put_batch(self, obj: dict) -> None:
        with self._lock:
            # an update in place (not INSERT OR REPLACE, which deletes and re-inserts): a batch
            # keeps its rowid, the lists' order among batches created in the same second, so
            # paging with `after` while batches progress neither skips nor repeats one
            self._db.execute("INSERT INTO batches VALUES (?, ?, ?, ?) ON CONFLICT(id) DO UPDATE "
                             "SET created_at = excluded.created_at, status = excluded.status, "
                             "obj = excluded.obj",
                             (obj["id"], obj["created_at"], obj["status"], json.dumps(obj)))

    def get_batch(self, batch_id: str) -> dict | None:
        return self._one("SELECT obj FROM batches WHERE id = ?", (batch_id,))

    def list_batches(self) -> list[dict]:
        return self._all("SELECT obj FROM batches ORDER BY created_at DESC, rowid DESC", ())

    def active_batches(self) -> list[dict]:
        marks = ", ".join("?" * len(ACTIVE))
        return self._all(f"SELECT obj FROM batches WHERE status IN ({marks}) "
                         "ORDER BY created_at, rowid", ACTIVE)

    def _one(self, sql: str, args: tuple) -> dict | None:
        with self._lock:
            row = self._db.execute(sql, args).fetchone()
        return json.loads(row[0]) if row else None

    def _all(self, sql: str, args: tuple) -> list[dict]:
        with self._lock:
            rows = self._db.execute(sql, args).fetchall()
        return [json.loads(r[0]) for r in rows]


def sync_dir(path: str) -> None:
    """fsyncs the folder `path`: a file created or renamed in it keeps its name after a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
