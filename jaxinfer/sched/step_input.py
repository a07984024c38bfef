"""make_step_input: a SchedulerOutput -> the padded numpy arrays of one compiled step.

Host-only (no JAX). T (tokens), S (sequences) and P (pages per sequence) are padded up to shape
buckets (powers of two), so a handful of executables serve every batch; `StepBuckets.all_shapes()`
lists them for warm-up. Padding needs no masks:
  padding token j    input_id 0, position 0, slot j % page_size (the null page 0)
  padding sequence   q_len 0 (cu_q_lens repeats its last value), kv_len 0, pages all 0
  padding row        logits_indices 0, greedy, neutral penalties
R (sampled rows) == S: row s samples from the last new token of sequence s (a mid-prompt chunk's
row is computed and ignored by `Scheduler.update`).

Speculative decoding: a verifying sequence (1 + k new tokens: its last token, then k drafts) has
k + 1 rows, one per new token, so R = the total number of rows, padded to S if they fit, else to
T. (T is not padded up to K + 1: where the device's step time grows with T, as on a CPU, a request
whose policy verifies fewer drafts then pays for fewer tokens.) Per-row sampling
arrays are those of the row's request *as if the drafts before it were accepted* (its position,
its output history for penalties, its min_tokens ban). The optional spec_* arrays (Sv = S rows,
K = num_speculative_tokens columns) tell the step which rows to verify against which drafts; the
draft_* arrays (a draft-model engine, every step) say how many drafts each sequence's draft model
proposes for the next step. So a (T, S) has two layouts: with and without verification.

Prompt logprobs: a prefill chunk of a request that asked for them has one row per position whose
logits score a prompt token (its last new tokens), then its sampled row; `target_token_ids` names
each such row's prompt token and the step returns that token's logprob there (R = T when the rows
outnumber S, as for verification; these layouts compile on first use).

One host->device copy: `StepInput.pack()` gives one i32 buffer and its static layout
(sched/step_buffer.py): the arrays of `_ARRAY_FIELDS` in that order, optional ones only when
present. Buckets (T, S, P and the per-row widths) are sched/buckets.py's.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Iterator

import numpy as np

from jaxinfer.config import EngineConfig
from jaxinfer.sched.buckets import StepBuckets, width_bucket
from jaxinfer.sched.output import SchedulerOutput
from jaxinfer.sched.step_buffer import PackedLayout, pack


@dataclasses.dataclass
class StepInput:
    # model + attention (AttentionMetadata fields)
    input_ids: np.ndarray  # i32[T]
    positions: np.ndarray  # i32[T]
    slot_mapping: np.ndarray  # i32[T] page_id * page_size + offset; padding -> null page 0
    cu_q_lens: np.ndarray  # i32[S+1]
    kv_lens: np.ndarray  # i32[S] context incl. this step's tokens; 0 for padding
    page_indices: np.ndarray  # i32[S, P]
    num_seqs: np.ndarray  # i32[1] real sequences
    logits_indices: np.ndarray  # i32[R] index into T of each row's last new token
    # sampling, one entry per row (SamplingMetadata fields)
    temperature: np.ndarray  # f32[R] 0 -> greedy
    top_k: np.ndarray  # i32[R] <= 0 -> off
    top_p: np.ndarray  # f32[R] 1 -> off
    min_p: np.ndarray  # f32[R] 0 -> off
    seeds: np.ndarray  # u32[R]
    sample_positions: np.ndarray  # i32[R] position the sampled token will take (== kv_len)
    presence_penalty: np.ndarray  # f32[R]
    frequency_penalty: np.ndarray  # f32[R]
    repetition_penalty: np.ndarray  # f32[R]
    # host-side facts
    num_rows: int = 0  # real rows (== real sequences without speculation); rows beyond are padding
    num_real_tokens: int = 0
    num_top_logprobs: int = 0  # the largest top-k logprobs any row asked for
    needs_logprobs: bool = False
    all_greedy: bool = True
    # optional parts (None unless some row needs them; their widths are extra buckets)
    prompt_token_ids: np.ndarray | None = None  # i32[R, Wp] -1 padded (repetition penalty)
    output_token_ids: np.ndarray | None = None  # i32[R, Wo] -1 padded (all penalties)
    bias_token_ids: np.ndarray | None = None  # i32[R, B] -1 padded (values 0 there): add, never set
    bias_values: np.ndarray | None = None  # f32[R, B] logit_bias, and -inf on EOS/stop ids < min_tokens
    allowed_token_bitmask: np.ndarray | None = None  # i32[R, W] W = ceil(V / 32): bit t % 32 of word
    #   t // 32 set -> token t allowed; a constrained request's rows from its grammar, others -1
    # prompt logprobs (None unless some row scores a prompt token)
    target_token_ids: np.ndarray | None = None  # i32[R] the next prompt token, whose logprob the
    #   row returns instead of its sampled token's; -1: an ordinary row
    # speculative verification (None unless some sequence verifies drafts)
    spec_row_ids: np.ndarray | None = None  # i32[Sv, K+1] rows of each verified position; R = padding
    spec_draft_ids: np.ndarray | None = None  # i32[Sv, K] drafts, -1 padded
    spec_num_draft: np.ndarray | None = None  # i32[Sv] real drafts (0 for padding)
    spec_seq_ids: np.ndarray | None = None  # i32[Sv] the sequence (S = padding)
    spec_store_rows: np.ndarray | None = None  # i32[Sv] page-table row: where its draft q is kept
    # draft model (present in every step of a draft-model engine)
    draft_k: np.ndarray | None = None  # i32[S] drafts to propose after verification (0: none)
    seq_rows: np.ndarray | None = None  # i32[S] first row of each sequence
    seq_store_rows: np.ndarray | None = None  # i32[S] page-table row (max_num_seqs = padding)

    @property
    def shape(self) -> tuple[int, int, int]:
        """(T, S, P)"""
        return (self.input_ids.shape[0],) + self.page_indices.shape

    def array_fields(self) -> list[str]:
        return [f for f in _ARRAY_FIELDS if getattr(self, f) is not None]

    def pack(self) -> tuple[np.ndarray, PackedLayout]:
        """Every array in one i32 buffer (f32/u32 bit-for-bit) and its layout."""
        return pack((name, getattr(self, name)) for name in self.array_fields())


_SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seeds", "sample_positions",
                    "presence_penalty", "frequency_penalty", "repetition_penalty")
_SPEC_FIELDS = ("spec_row_ids", "spec_draft_ids", "spec_num_draft", "spec_seq_ids",
                "spec_store_rows")
_DRAFT_FIELDS = ("draft_k", "seq_rows", "seq_store_rows")
_ARRAY_FIELDS = ("input_ids", "positions", "slot_mapping", "cu_q_lens", "kv_lens", "page_indices",
                 "num_seqs", "logits_indices") + _SAMPLING_FIELDS + (
                    "prompt_token_ids", "output_token_ids", "bias_token_ids", "bias_values",
                    "allowed_token_bitmask", "target_token_ids") + _SPEC_FIELDS + _DRAFT_FIELDS


# -- building -------------------------------------------------------------------------------
def make_step_input(sched_out: SchedulerOutput, engine_config: EngineConfig, max_model_len: int,
                    *, buckets: StepBuckets | None = None, bitmask_words: int = 0) -> StepInput:
    """The step of `sched_out` in its shape bucket. `bitmask_words` W > 0 (an engine that takes
    constrained requests): every step carries an allowed-token bitmask i32[R, W], all ones where
    no request is constrained, so one executable per shape serves both (`with_bitmask`)."""
    buckets = buckets or StepBuckets.from_config(engine_config, max_model_len)
    items = sched_out.scheduled
    pages_per_seq = max((len(it.request.page_ids) for it in items), default=1)  # P bucket >= this
    rows = _Rows(items)
    shape = buckets.pick(sched_out.num_batched_tokens, len(items), pages_per_seq)
    num_rows = shape[1] if rows.num_rows <= shape[1] else shape[0]  # R: S, or T when rows > S
    si = empty_step_input(*shape, buckets.page_size, num_rows=num_rows)
    _fill_attention(si, sched_out, buckets.page_size)
    if rows.num_rows != len(items):
        si.logits_indices[:rows.num_rows] = rows.logits_indices(si.cu_q_lens)
        si.num_rows = rows.num_rows
    si.sample_positions[:si.num_rows] = si.positions[si.logits_indices[:si.num_rows]] + 1
    _fill_sampling(si, sched_out, rows)
    _fill_optional(si, sched_out, rows)
    with_bitmask(si, bitmask_words)
    if any(it.spec_token_ids for it in items):
        _fill_spec(si, items, rows, engine_config.num_speculative_tokens)
    if any(it.num_prompt_rows for it in items):
        _fill_prompt_targets(si, items, rows)
    if engine_config.speculative_method == "draft":
        _fill_draft(si, items, rows, engine_config.max_num_seqs)
    return si


class _Rows:
    """Sampled rows of a step: `item.num_rows` per scheduled item, in order."""

    def __init__(self, items):
        self.per_item = np.fromiter((it.num_rows for it in items), np.int64, len(items))  # i64[n]
        self.num_rows = int(self.per_item.sum())
        self.starts = np.concatenate([[0], np.cumsum(self.per_item)])[:-1]  # i64[n] first row
        if self.num_rows == len(items):
            self.item = np.arange(len(items))  # i64[R] the item of each row
            self.offset = np.zeros(len(items), np.int64)  # i64[R] drafts before the row
        else:
            self.item = np.repeat(np.arange(len(items)), self.per_item)
            self.offset = np.arange(self.num_rows) - self.starts[self.item]

    def logits_indices(self, cu_q_lens: np.ndarray) -> np.ndarray:
        """i64[R]: a row's token is the offset-th of its item's last `num_rows` new tokens."""
        ends = cu_q_lens[1:len(self.per_item) + 1].astype(np.int64)
        return ends[self.item] - self.per_item[self.item] + self.offset


def empty_step_input(num_tokens: int, num_seqs: int, pages_per_seq: int, page_size: int, *,
                     num_rows: int | None = None) -> StepInput:
    """All padding: a valid step that only writes to the null page (also the warm-up input).
    `num_rows` (R): sampled rows, default S."""
    T, S, P = num_tokens, num_seqs, pages_per_seq
    R = S if num_rows is None else num_rows
    i32, f32 = np.int32, np.float32
    return StepInput(
        input_ids=np.zeros(T, i32),
        positions=np.zeros(T, i32),
        slot_mapping=(np.arange(T) % page_size).astype(i32),
        cu_q_lens=np.zeros(S + 1, i32),
        kv_lens=np.zeros(S, i32),
        page_indices=np.zeros((S, P), i32),
        num_seqs=np.zeros(1, i32),
        logits_indices=np.zeros(R, i32),
        temperature=np.zeros(R, f32),
        top_k=np.zeros(R, i32),
        top_p=np.ones(R, f32),
        min_p=np.zeros(R, f32),
        seeds=np.zeros(R, np.uint32),
        sample_positions=np.zeros(R, i32),
        presence_penalty=np.zeros(R, f32),
        frequency_penalty=np.zeros(R, f32),
        repetition_penalty=np.ones(R, f32),
    )


def warmup_step_inputs(engine_config: EngineConfig, max_model_len: int, *,
                       buckets: StepBuckets | None = None,
                       bitmask_words: int = 0) -> Iterator[StepInput]:
    """One all-padding StepInput per shape bucket (compiling each touches only the null page);
    with speculation also each verifying layout (R = S, and R = T where T > S). `bitmask_words`
    W > 0: each with an all-ones allowed-token bitmask i32[R, W], as make_step_input gives every
    step then."""
    buckets = buckets or StepBuckets.from_config(engine_config, max_model_len)
    method, k = engine_config.speculative_method, engine_config.num_speculative_tokens
    for shape in buckets.all_shapes():
        num_tokens, num_seqs = shape[:2]
        variants = [None]
        if method is not None and num_tokens >= 2:
            variants += sorted({num_seqs, num_tokens})
        for num_rows in variants:
            si = empty_step_input(*shape, buckets.page_size, num_rows=num_rows)
            if num_rows is not None:
                _verify_nothing(si, k)
            if method == "draft":
                _fill_draft(si, [], _Rows([]), engine_config.max_num_seqs)
            yield with_bitmask(si, bitmask_words)


def with_bitmask(si: StepInput, bitmask_words: int) -> StepInput:
    """`si` (in place) with an all-ones allowed-token bitmask i32[R, W] where it has none and
    W = `bitmask_words` > 0: the layout every step of an engine that takes constrained requests
    has, so a step with one compiles to the same executable as a step without (the sampler
    takes its masked paths only where some word has a zero bit: runtime/sampler.py)."""
    if bitmask_words and si.allowed_token_bitmask is None:
        si.allowed_token_bitmask = np.full((si.seeds.shape[0], bitmask_words), -1, np.int32)
    return si


def _verify_nothing(si: StepInput, k: int) -> None:
    """The verification arrays of `si`'s layout (K = k), every spec row padding."""
    num_seqs, num_rows = si.page_indices.shape[0], si.seeds.shape[0]
    si.spec_row_ids = np.full((num_seqs, k + 1), num_rows, np.int32)
    si.spec_draft_ids = np.full((num_seqs, k), -1, np.int32)
    si.spec_num_draft = np.zeros(num_seqs, np.int32)
    si.spec_seq_ids = np.full(num_seqs, num_seqs, np.int32)
    si.spec_store_rows = np.zeros(num_seqs, np.int32)


def calibration_step_inputs(engine_config: EngineConfig, max_model_len: int, *,
                            buckets: StepBuckets | None = None,
                            bitmask_words: int = 0) -> Iterator[tuple[int, StepInput]]:
    """(t, a step of t real tokens) for the step times the speculation policy weighs
    (`LLMEngine.calibrate_speculation`): one sequence of t = 1 .. K + 1 tokens, each a sampled
    row (a single stream verifying t - 1 drafts, in that step's layout), then each larger token
    bucket T full, its T tokens spread over its sequences (a batch or a prefill). The tokens are
    real to the step, so it costs what a step of t tokens does (the CPU's quantized matmuls skip
    the padding rows after them: `ops.quantized_matmul`'s num_rows), but they write and read only
    the null page, as padding does. Their input ids are 0. `bitmask_words`: as
    warmup_step_inputs (the warmed-up layouts)."""
    buckets = buckets or StepBuckets.from_config(engine_config, max_model_len)
    method, k = engine_config.speculative_method, engine_config.num_speculative_tokens
    largest_seqs = engine_config.max_num_seqs
    # (tokens, sequences, sampled rows): a verification samples every token, a batch a row a
    # sequence
    counts = [(t, 1, t) for t in range(1, k + 2) if t <= buckets.token_buckets[-1]]
    counts += [(t, min(t, largest_seqs), min(t, largest_seqs)) for t in buckets.token_buckets
               if t > k + 1]
    for t, num_seqs, rows in counts:
        q_lens = np.full(num_seqs, t // num_seqs) + (np.arange(num_seqs) < t % num_seqs)
        shape = buckets.pick(t, num_seqs, -(-int(q_lens[0]) // buckets.page_size))
        num_rows = shape[1] if rows <= shape[1] else shape[0]
        si = empty_step_input(*shape, buckets.page_size, num_rows=num_rows)
        if method is not None and rows > num_seqs:
            _verify_nothing(si, k)
        if method == "draft":
            _fill_draft(si, [], _Rows([]), largest_seqs)
        _real_tokens_on_the_null_page(si, q_lens, rows)
        yield t, with_bitmask(si, bitmask_words)


def _real_tokens_on_the_null_page(si: StepInput, q_lens: np.ndarray, rows: int) -> None:
    """`si`'s first sum(q_lens) tokens become one sequence of each length (i64[n]), each a prompt
    from position 0 whose pages are all the null page; its first `rows` rows sample every token
    (rows == the tokens) or each sequence's last one."""
    n, t = len(q_lens), int(q_lens.sum())
    si.cu_q_lens[1:n + 1] = np.cumsum(q_lens)
    si.cu_q_lens[n + 1:] = t
    si.kv_lens[:n] = q_lens
    si.num_seqs[0] = n
    si.positions[:t] = np.concatenate([np.arange(q) for q in q_lens])
    si.logits_indices[:rows] = np.arange(t) if rows == t else si.cu_q_lens[1:rows + 1] - 1


def _fill_attention(si: StepInput, sched_out: SchedulerOutput, page_size: int) -> None:
    """Vectorised: page rows are gathered from the scheduler's PageTable; per-token arrays by numpy."""
    items = sched_out.scheduled
    n = len(items)
    starts = np.fromiter((it.num_computed_tokens for it in items), np.int64, n)  # i64[n]
    q_lens = np.fromiter((it.num_new_tokens for it in items), np.int64, n)  # i64[n]
    table_rows = np.fromiter((it.request.page_table_row for it in items), np.int64, n)  # i64[n]
    cu = np.concatenate([[0], np.cumsum(q_lens)])  # i64[n+1]
    t = int(cu[-1])
    rows = np.repeat(np.arange(n), q_lens)  # i64[t] the sequence of each token
    pos = starts[rows] + np.arange(t) - cu[:-1][rows]  # i64[t]
    width = min(si.page_indices.shape[1], sched_out.page_table.shape[1])
    page_table = si.page_indices[:n]  # i32[n, P]
    page_table[:, :width] = sched_out.page_table[table_rows, :width]
    si.input_ids[:t] = np.fromiter(itertools.chain.from_iterable(
        it.token_ids if it.spec_token_ids else
        it.request.all_token_ids[it.num_computed_tokens:it.num_computed_tokens + it.num_new_tokens]
        for it in items), np.int32, t)
    si.positions[:t] = pos
    si.slot_mapping[:t] = page_table[rows, pos // page_size].astype(np.int64) * page_size + pos % page_size
    si.cu_q_lens[:n + 1] = cu
    si.cu_q_lens[n + 1:] = t
    si.kv_lens[:n] = starts + q_lens
    si.num_seqs[0] = n
    si.logits_indices[:n] = cu[1:] - 1
    si.num_rows, si.num_real_tokens = n, t


F32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32, 2**-126
MAX_TEMPERATURE = 1.0 / F32_TINY  # 2**126: its reciprocal is still a normal float32


def _fill_sampling(si: StepInput, sched_out: SchedulerOutput, rows: _Rows) -> None:
    items = sched_out.scheduled
    n = len(items)
    if n == 0:
        return
    sps = [it.request.sampling_params for it in items]
    # float64 values brought into float32's range: a temperature whose reciprocal is below
    # float32's smallest normal (XLA may divide by multiplying with it, and the CPU flushes it
    # to 0: -inf logits x 0 are NaN), a top_p below it (0 or flushed: no token kept); at these
    # bounds the sampler keeps their meaning (all tokens alike; the most likely one)
    per_item = {
        "temperature": [min(sp.temperature, MAX_TEMPERATURE) for sp in sps],
        "top_k": [min(max(sp.top_k, 0), 2**31 - 1) for sp in sps],
        "top_p": [max(sp.top_p, F32_TINY) for sp in sps],
        "min_p": [sp.min_p for sp in sps],
        "seeds": [it.request.seed & 0xFFFFFFFF for it in items],
        "presence_penalty": [sp.presence_penalty for sp in sps],
        "frequency_penalty": [sp.frequency_penalty for sp in sps],
        "repetition_penalty": [sp.repetition_penalty for sp in sps],
    }
    r = rows.num_rows
    for name, values in per_item.items():
        a = getattr(si, name)
        a[:n] = values
        if r != n:
            a[:r] = a[:n][rows.item]
    top_logprobs = [k for sp in sps for k in (sp.logprobs, sp.prompt_logprobs) if k is not None]
    si.needs_logprobs = bool(top_logprobs)
    si.num_top_logprobs = max(top_logprobs, default=0)
    si.all_greedy = bool(np.all(si.temperature[:r] == 0.0))


def _fill_optional(si: StepInput, sched_out: SchedulerOutput, rows: _Rows) -> None:
    items, num_rows = sched_out.scheduled, si.seeds.shape[0]
    # a row `offset` drafts into a verification sees those drafts as already generated (other
    # rows of an item, prompt-logprob rows, share its sampled row's state)
    row_items = [(items[i], int(j) if items[i].spec_token_ids else 0)
                 for i, j in zip(rows.item, rows.offset)]
    if any(it.request.sampling_params.has_penalties for it in items):
        si.prompt_token_ids = _pad_rows([it.request.prompt_token_ids for it, _ in row_items],
                                        num_rows)
        si.output_token_ids = _pad_rows(
            [it.request.output_token_ids + it.spec_token_ids[:j] if j else
             it.request.output_token_ids for it, j in row_items], num_rows)
    biases = [_row_bias(it, sched_out.eos_token_ids, j) for it, j in row_items]
    if any(biases):
        width = width_bucket(max(len(b) for b in biases))
        si.bias_token_ids = np.full((num_rows, width), -1, np.int32)
        si.bias_values = np.zeros((num_rows, width), np.float32)
        for r, b in enumerate(biases):
            si.bias_token_ids[r, :len(b)] = list(b.keys())
            si.bias_values[r, :len(b)] = list(b.values())
    if any(it.request.grammar is not None for it in items):
        _fill_bitmask(si, items, rows)


def _fill_bitmask(si: StepInput, items, rows: _Rows) -> None:
    """Each constrained item's rows get its grammar's masks; the rest -1. A verifying item's row
    j gets the mask after its drafts before j (as if accepted: what the step verifies against);
    otherwise one mask, shared by the prompt-logprob rows and the sampled row."""
    grammars = [it.request.grammar for it in items]
    with_bitmask(si, next(g.num_words for g in grammars if g is not None))
    for i, g in enumerate(grammars):
        if g is None:
            continue
        first, n = rows.starts[i], rows.per_item[i]
        if items[i].spec_token_ids:
            g.fill_draft_bitmasks(si.allowed_token_bitmask[first:first + n],
                                  items[i].spec_token_ids)
            continue
        g.fill_bitmask(si.allowed_token_bitmask[first + n - 1])
        if n > 1:
            si.allowed_token_bitmask[first:first + n - 1] = si.allowed_token_bitmask[first + n - 1]


def _fill_spec(si: StepInput, items, rows: _Rows, k: int) -> None:
    verifying = [i for i, it in enumerate(items) if it.spec_token_ids]
    num_rows, num_seqs = si.seeds.shape[0], si.kv_lens.shape[0]
    num_spec = num_seqs  # Sv = S: one verifying layout per (T, S)
    si.spec_row_ids = np.full((num_spec, k + 1), num_rows, np.int32)
    si.spec_draft_ids = np.full((num_spec, k), -1, np.int32)
    si.spec_num_draft = np.zeros(num_spec, np.int32)
    si.spec_seq_ids = np.full(num_spec, num_seqs, np.int32)
    si.spec_store_rows = np.zeros(num_spec, np.int32)
    for v, i in enumerate(verifying):
        drafts = items[i].spec_token_ids
        if len(drafts) > k:
            raise ValueError(f"{len(drafts)=} drafts exceed num_speculative_tokens={k}")
        si.spec_row_ids[v, :len(drafts) + 1] = rows.starts[i] + np.arange(len(drafts) + 1)
        si.spec_draft_ids[v, :len(drafts)] = drafts
        si.spec_num_draft[v] = len(drafts)
        si.spec_seq_ids[v] = i
        si.spec_store_rows[v] = items[i].request.page_table_row


def _fill_prompt_targets(si: StepInput, items, rows: _Rows) -> None:
    """target_token_ids: a prompt-logprob row at position p scores prompt token p + 1."""
    si.target_token_ids = np.full(si.seeds.shape[0], -1, np.int32)
    for i, it in enumerate(items):
        if it.num_prompt_rows:
            start = rows.starts[i]
            si.target_token_ids[start:start + it.num_prompt_rows] = it.prompt_row_targets()


def _fill_draft(si: StepInput, items, rows: _Rows, max_num_seqs: int) -> None:
    num_seqs, n = si.kv_lens.shape[0], len(items)
    si.draft_k = np.zeros(num_seqs, np.int32)
    si.draft_k[:n] = [it.num_lookahead for it in items]
    si.seq_rows = np.zeros(num_seqs, np.int32)
    si.seq_rows[:n] = rows.starts
    si.seq_store_rows = np.full(num_seqs, max_num_seqs, np.int32)
    si.seq_store_rows[:n] = [it.request.page_table_row for it in items]


def _row_bias(it, eos_token_ids: frozenset[int], num_drafts_before: int = 0) -> dict[int, float]:
    """logit_bias, plus -inf on EOS / stop_token_ids while the row is below min_tokens."""
    req = it.request
    sp = req.sampling_params
    num_output = req.num_output_tokens + num_drafts_before
    if not sp.logit_bias and num_output >= sp.min_tokens:
        return {}
    bias = dict(sp.logit_bias or {})
    if num_output < sp.min_tokens:
        banned = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(eos_token_ids))
        bias.update({t: float("-inf") for t in banned})
    return bias


def _pad_rows(rows: list[list[int]], num_rows: int) -> np.ndarray:
    width = width_bucket(max((len(r) for r in rows), default=0))
    out = np.full((num_rows, width), -1, np.int32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out
