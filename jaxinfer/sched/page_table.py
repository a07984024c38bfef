"""PageTable: a numpy mirror of the running requests' page ids, one row per running request.

Host-only (no JAX). The scheduler writes only what changes (a new page, a released row), so a
step's `page_indices` is one numpy gather instead of a rebuild from Python lists every step.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


class PageTable:
    def __init__(self, num_rows: int, max_pages_per_seq: int):
        self.table = np.zeros((num_rows, max_pages_per_seq), np.int32)  # i32[rows, pages_per_seq]
        self._num_pages = [0] * num_rows
        self._free_rows = list(range(num_rows - 1, -1, -1))  # row 0 handed out first

    @property
    def max_pages_per_seq(self) -> int:
        return self.table.shape[1]

    def add_row(self, page_ids: Sequence[int]) -> int:
        if not self._free_rows:
            raise ValueError("no free page-table row: more running requests than max_num_seqs")
        row = self._free_rows.pop()
        self.append(row, page_ids)
        return row

    def append(self, row: int, page_ids: Sequence[int]) -> None:
        start = self._num_pages[row]
        if start + len(page_ids) > self.max_pages_per_seq:
            raise ValueError(f"{start + len(page_ids)} pages exceed {self.max_pages_per_seq} per sequence")
        self.table[row, start:start + len(page_ids)] = page_ids
        self._num_pages[row] = start + len(page_ids)

    def truncate(self, row: int, num_pages: int) -> None:
        """Keeps the row's first `num_pages` pages (speculative rollback frees the rest)."""
        self.table[row, num_pages:self._num_pages[row]] = 0
        self._num_pages[row] = min(self._num_pages[row], num_pages)

    def free_row(self, row: int) -> None:
        self.table[row, :self._num_pages[row]] = 0
        self._num_pages[row] = 0
        self._free_rows.append(row)

    def row(self, row: int) -> list[int]:
        return self.table[row, :self._num_pages[row]].tolist()

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)
