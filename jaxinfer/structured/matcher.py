"""RequestGrammar: one request's place in its grammar (an llguidance matcher) on the host.

Per step the step builder asks it for the request's allowed-token bitmask row (`fill_bitmask`), and
the scheduler advances it with each token the request accepted (`advance`), which says when the
grammar is complete with nothing else allowed (the request then finishes with "stop").
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
