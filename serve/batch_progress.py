"""What a batch job tells the person running it: a tqdm bar on stderr while it runs (lines
answered, output tokens per second) and one summary line at the end."""

from __future__ import annotations

import dataclasses
import sys
import time

from tqdm import tqdm

from serve.batch_rows import completion_tokens


class Progress:
    """The bar of one run, from the lines answered before it; `enabled=False` shows none."""

    def __init__(self, total: int, already_done: int, *, enabled: bool = True):
        self.output_tokens = 0
        self._t0 = time.monotonic()
        self._bar = tqdm(total=total, initial=already_done, desc="batch", unit="line",
                         file=sys.stderr, disable=not enabled, dynamic_ncols=True)

    def update(self, row: dict) -> None:
        self.output_tokens += completion_tokens(row)
        rate = self.output_tokens / max(time.monotonic() - self._t0, 1e-9)
        self._bar.set_postfix_str(f"{rate:.1f} out tok/s", refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()


@dataclasses.dataclass(frozen=True)
class Summary:
    total: int  # lines in the input
    done_now: int  # answered by this run
    already_done: int  # answered in the output before this run
    failed: int  # lines whose answer (from any run) is a failure
    torn_bytes: int = 0  # a torn last line cut from the output
    unknown: int = 0  # answers in the output for no line of this input

    @property
    def exit_status(self) -> int:
        """0 when every line has an answer that is not a failure, else 1."""
        complete = self.done_now + self.already_done == self.total
        return 0 if complete and self.failed == 0 else 1

    def line(self, output_path: str) -> str:
        notes = []
        if self.torn_bytes:
            notes.append(f"cut a torn last line ({self.torn_bytes} bytes) and redid its request")
        if self.unknown:
            notes.append(f"{self.unknown} answers in the output match no input line")
        return (f"{self.done_now} done now, {self.already_done} already done, {self.failed} "
                f"failed, of {self.total} lines -> {output_path}"
                + "".join(f"; {n}" for n in notes))
