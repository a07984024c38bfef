"""The output file of a batch job, written so that a job killed at any moment can be rerun.

Each answer is appended as one line and flushed to the OS the moment its request finishes, so a
killed process loses no finished line, and the file is in completion order, not input order.
os.fsync runs at most `sync_interval_s` after a write (the job calls `sync_due` on a timer) and
when the file is closed, which bounds what a crash of the machine can lose; the first fsync of a
file the job created also fsyncs its folder, so the file's name survives such a crash too. While a job has the
file open it holds an exclusive lock on it (flock), so two jobs never append to the same file.

Opening the file reads the answers already there, which a rerun skips. Every line must be a
result line (serve/batch_rows.py) except the last, which may be torn: without its newline, as a
kill in the middle of a write leaves it (a row and its newline go out in one write). A torn last
line is cut away, and its request is asked again; it must look like the start of a row, or
follow result lines, so that a file of something else given as the output is refused, not cut.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from typing import Self

from serve.batch_rows import is_failure, is_result_row
from serve.store import sync_dir


class ResultFile:
    """`path` opened for appending answers (created if missing); `answers` maps each custom_id
    answered already to whether its answer is a failure; `torn_bytes` is what was cut away."""

    def __init__(self, path: str, *, sync_interval_s: float = 1.0):
        self.path = path
        self.sync_interval_s = sync_interval_s
        self._dir_synced = os.path.exists(path)  # a new file's folder entry is fsynced once
        try:
            self._f = open(path, "ab")  # noqa: SIM115 - open while the job runs
        except IsADirectoryError:
            raise ValueError(f"output {path!r} is a directory") from None
        except OSError as e:
            raise ValueError(f"cannot write the output {path!r}: {e.strerror}") from None
        try:
            try:
                fcntl.flock(self._f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ValueError(f"output {path!r} is in use by another batch job") from None
            self.answers, self.torn_bytes = _recover(path, self._f.fileno())
        except BaseException:
            self._f.close()
            raise
        self._dirty = False
        self._last_sync = time.monotonic()

    def write(self, row: dict) -> None:
        """Appends `row` as one line and flushes it (fsync follows within `sync_interval_s`)."""
        self._f.write((json.dumps(row) + "\n").encode())
        self._f.flush()
        self.answers.setdefault(row["custom_id"], is_failure(row))
        self._dirty = True
        self.sync_due()

    def sync_due(self) -> None:
        """fsync if a line was written and the last fsync is `sync_interval_s` old."""
        if self._dirty and time.monotonic() - self._last_sync >= self.sync_interval_s:
            self.sync()

    def sync(self) -> None:
        if self._dirty:
            os.fsync(self._f.fileno())
            self._dirty = False
        if not self._dir_synced:
            sync_dir(os.path.dirname(os.path.abspath(self.path)))
            self._dir_synced = True
        self._last_sync = time.monotonic()

    def close(self) -> None:
        if self._f.closed:
            return
        try:
            self.sync()
        finally:
            self._f.close()  # releases the lock

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _recover(path: str, fd: int) -> tuple[dict[str, bool], int]:
    """The answers in the file, after cutting away a torn last line (fsynced)."""
    with open(path, "rb") as f:
        data = f.read()
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()  # the file ends with a newline (or is empty): no torn tail
    answers: dict[str, bool] = {}
    cut = 0
    for number, raw in enumerate(lines, 1):
        last = number == len(lines)
        complete = not last or data.endswith(b"\n")  # the line has its newline
        if complete and not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except ValueError:  # JSONDecodeError and UnicodeDecodeError both are
            row = _TORN
        if is_result_row(row) and complete:
            answers.setdefault(row["custom_id"], is_failure(row))
        elif last and not complete and (raw.startswith(b"{") or answers):
            cut = len(raw)  # a row cut short (a row is written with its newline in one write)
        else:
            raise ValueError(f"output {path!r}: line {number} is not a batch result line; "
                             "give another output file (or fix that line) to run this job")
    if cut:
        os.ftruncate(fd, len(data) - cut)
        os.fsync(fd)
    return answers, cut


_TORN = object()  # a line that is not JSON

