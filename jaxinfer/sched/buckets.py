"""Shape buckets: the padded sizes a step may take, so a handful of executables serve every batch.

Host-only (no JAX). A step has T tokens, S sequences and P pages per sequence; each is padded up
to a bucket (powers of two by default), and each (T, S, P) is one compiled executable, listed by
`StepBuckets.all_shapes()` for warm-up. Per-row lists (penalty histories, logit bias) are padded
to `width_bucket` widths, each width one more executable on first use.
"""

from __future__ import annotations

import dataclasses

from jaxinfer.config import EngineConfig

MIN_NUM_TOKENS = 8
MIN_NUM_SEQS = 1
MIN_PAGES_PER_SEQ = 1
MIN_HISTORY_WIDTH = 8


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def width_bucket(n: int) -> int:
    """The padded width of a per-row list of `n` entries (penalty history, logit bias)."""
    return next_power_of_2(max(MIN_HISTORY_WIDTH, n))


def _powers_of_2(lo: int, hi: int) -> tuple[int, ...]:
    """lo, 2lo, ... up to the first power of two >= hi (lo itself a power of two)."""
    out = [next_power_of_2(lo)]
    while out[-1] < hi:
        out.append(out[-1] * 2)
    return tuple(out)


def _pick(buckets: tuple[int, ...], n: int, name: str) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{name}={n} exceeds the largest bucket {buckets[-1]}")


@dataclasses.dataclass(frozen=True)
class StepBuckets:
    """The padded sizes a step may take. Any ascending tuples work (e.g. one fixed page width).

    With `coarse_seqs` (what the engine uses) S is not free: it is the smallest seq bucket when the
    step has that few sequences, else min(T, the largest seq bucket). Each T then has at most two
    S, so the executables number about 2x the token buckets instead of their product; padded rows
    cost one LM-head row each, small beside the T tokens of the step.
    """

    page_size: int
    token_buckets: tuple[int, ...]  # T
    seq_buckets: tuple[int, ...]  # S (== R)
    page_buckets: tuple[int, ...]  # P
    coarse_seqs: bool = False

    @classmethod
    def from_config(cls, engine_config: EngineConfig, max_model_len: int, *,
                    min_num_tokens: int = MIN_NUM_TOKENS, min_num_seqs: int = MIN_NUM_SEQS,
                    min_pages_per_seq: int = MIN_PAGES_PER_SEQ) -> "StepBuckets":
        ps = engine_config.page_size
        max_seqs = min(engine_config.max_num_seqs, engine_config.max_num_batched_tokens)
        return cls(
            page_size=ps,
            token_buckets=_powers_of_2(min_num_tokens, engine_config.max_num_batched_tokens),
            seq_buckets=_powers_of_2(min_num_seqs, max_seqs),
            page_buckets=_powers_of_2(min_pages_per_seq, -(-max_model_len // ps)),
        )

    @classmethod
    def coarse(cls, engine_config: EngineConfig, max_model_len: int, *,
               min_num_tokens: int = 1, exact_verify: bool = True,
               intermediate: bool = False) -> "StepBuckets":
        """Few executables: T powers of two from 1 (a single-stream decode step computes one token,
        not eight), S coarse (see above), P one fixed width (the attention's work follows the real
        context lengths, not P). With speculative decoding and `exact_verify`, T = 1 +
        num_speculative_tokens is a bucket too: a single stream's full verification step then pads
        nothing (the engine asks for it on the XLA path, where a CPU step's cost grows with T
        already from 1 to 8; the Pallas kernels keep power-of-two T). With `intermediate`, the
        decode sizes between 16 and max_num_seqs get a bucket at 1.5x each power of two (24, 48,
        ...) for T and S alike: a decode step of 40 sequences pays 48 rows, not 64 (on a CPU a
        step's matmuls cost about their rows from 16 rows up)."""
        ps = engine_config.page_size
        max_seqs = min(engine_config.max_num_seqs, engine_config.max_num_batched_tokens)
        small = min(min_num_tokens, next_power_of_2(max_seqs))
        seq_buckets = _powers_of_2(small, max_seqs)
        token_buckets = _powers_of_2(min_num_tokens, engine_config.max_num_batched_tokens)
        if intermediate:
            extra = {3 * b // 2 for b in seq_buckets if 16 <= b and 3 * b // 2 < max_seqs}
            seq_buckets = tuple(sorted({*seq_buckets, *extra}))
            token_buckets = tuple(sorted({*token_buckets, *extra}))
        if exact_verify and engine_config.speculative_method is not None:
            verify = 1 + engine_config.num_speculative_tokens
            if min_num_tokens <= verify <= token_buckets[-1]:
                token_buckets = tuple(sorted({*token_buckets, verify}))
        return cls(
            page_size=ps,
            token_buckets=token_buckets,
            seq_buckets=seq_buckets,
            page_buckets=(-(-max_model_len // ps),),
            coarse_seqs=True,
        )

    def _seq_bucket(self, num_tokens_bucket: int, num_seqs: int) -> int:
        if not self.coarse_seqs or num_seqs <= self.seq_buckets[0]:
            return _pick(self.seq_buckets, num_seqs, "num_seqs")
        return _pick(self.seq_buckets, min(num_tokens_bucket, self.seq_buckets[-1]), "num_seqs")

    def pick(self, num_tokens: int, num_seqs: int, pages_per_seq: int) -> tuple[int, int, int]:
        t = _pick(self.token_buckets, num_tokens, "num_tokens")
        return (t, self._seq_bucket(t, num_seqs),
                _pick(self.page_buckets, pages_per_seq, "pages_per_seq"))

    def all_shapes(self) -> list[tuple[int, int, int]]:
        """Every (T, S, P) `pick` can return (a step has at least one token per sequence)."""
        if self.coarse_seqs:
            ts = sorted({(t, self._seq_bucket(t, n)) for t in self.token_buckets
                         for n in (1, min(t, self.seq_buckets[-1]))})
            return [(t, s, p) for t, s in ts for p in self.page_buckets]
        return [(t, s, p) for t in self.token_buckets for s in self.seq_buckets
                if s <= max(t, self.seq_buckets[0]) for p in self.page_buckets]


def all_buckets(engine_config: EngineConfig, max_model_len: int) -> list[tuple[int, int, int]]:
    return StepBuckets.from_config(engine_config, max_model_len).all_shapes()
