"""RequestGrammar: one request's place in its grammar (an llguidance matcher) on the host.

Per step the step builder asks it for the request's allowed-token bitmask row (`fill_bitmask`), and
the scheduler advances it with each token the request accepted (`advance`), which says when the
grammar is complete with nothing else allowed (the request then finishes with "stop").
Speculative decoding: `num_valid_drafts` cuts a request's drafts to the prefix its grammar accepts
(before the step), and `fill_draft_bitmasks` gives one row per verified position, the mask after
the drafts before it; both leave the matcher where it was (llguidance's rollback).
Bitmask layout (the sampler's): i32[W], W = ceil(V / 32), bit t % 32 of word t // 32 set -> token t
allowed.
"""

from __future__ import annotations

import logging

import numpy as np

logger = logging.getLogger(__name__)


def bitmask_words(vocab_size: int) -> int:
    """W: i32 words of one bitmask row over `vocab_size` tokens."""
    return -(-vocab_size // 32)


class RequestGrammar:
    """Wraps a fresh `llguidance.LLMatcher` (a copy of the compiled one) for one request."""

    def __init__(self, matcher, vocab_size: int):
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.num_words = bitmask_words(vocab_size)

    def fill_bitmask(self, row: np.ndarray) -> None:
        """Writes the tokens allowed next into `row` (i32[W], C-contiguous)."""
        if row.dtype != np.int32 or row.shape != (self.num_words,) or not row.flags["C_CONTIGUOUS"]:
            raise ValueError(f"bitmask row must be contiguous i32[{self.num_words}], got "
                             f"{row.dtype}{list(row.shape)}")
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def bitmask(self) -> np.ndarray:
        """i32[W]: a new row with the tokens allowed next."""
        row = np.empty(self.num_words, np.int32)
        self.fill_bitmask(row)
        return row

    def num_valid_drafts(self, draft_ids: list[int]) -> int:
        """How many leading drafts the grammar accepts from here, stopping after the one that
        completes it (a request ends there, so drafts past it would be wasted)."""
        m = self._matcher
        num_valid = m.validate_tokens(draft_ids) if draft_ids else 0
        num_consumed = 0
        while num_consumed < num_valid and not m.is_stopped():
            m.consume_token(draft_ids[num_consumed])
            num_consumed += 1
        if num_consumed:
            m.rollback(num_consumed)
        return num_consumed

    def fill_draft_bitmasks(self, rows: np.ndarray, draft_ids: list[int]) -> None:
        """rows i32[d+1, W] (d = len(draft_ids), drafts from `num_valid_drafts`): row j gets the
        tokens allowed after the drafts before j, as if they were accepted."""
        if rows.shape[0] != len(draft_ids) + 1:
            raise ValueError(f"{rows.shape=} must have len(draft_ids) + 1 = "
                             f"{len(draft_ids) + 1} rows")
        m = self._matcher
        num_consumed = 0
        for j in range(len(draft_ids) + 1):
            if j and not m.is_stopped():
                if m.validate_tokens(draft_ids[j - 1:j]) != 1:  # checked first: no error state
                    if num_consumed:
                        m.rollback(num_consumed)
                    raise ValueError(f"draft {draft_ids[j - 1]} (position {j - 1}) is refused by "
                                     "the grammar: drafts must come from num_valid_drafts")
                m.consume_token(draft_ids[j - 1])
                num_consumed += 1
            self.fill_bitmask(rows[j])
        if num_consumed:
            m.rollback(num_consumed)

    def advance(self, token_id: int) -> bool:
        """Consumes a sampled token; True when the request must stop here: the grammar is complete
        and allows nothing more (or it refused the token, which the mask should make impossible)."""
        m = self._matcher
        if not m.consume_token(token_id):
            logger.warning("grammar refused token %d: %s", token_id, m.get_error())
            return True
        return m.is_stopped()

    @property
    def is_accepting(self) -> bool:
        return self._matcher.is_accepting()

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None
