"""A fake engine implementing EngineClient (jaxinfer/engine/client.py) as LLMEngine does, for the
server tests.

No JAX: a byte-level tokenizer and a deterministic "model" (greedy output cycles through a fixed
sentence; seeded sampling draws bytes from a PRNG seeded with an integer of (seed, position)). It keeps a page pool
so tests can check that aborted and finished requests give their pages back, runs at most
`max_num_seqs` requests per step, and asserts that every call comes from a single thread. As in
LLMEngine, `step(detokenize=False)` returns token-only outputs (empty text) and leaves stop strings
to the caller (AsyncEngine's TextTracker, which ends the request with `finish_request`);
`step()` detokenizes and stops at stop strings itself, with the same TextTracker.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time

from jaxinfer.engine import EngineMetrics
from jaxinfer.engine.outputs import TextTracker
from jaxinfer.request import CompletionOutput, RequestMetrics, RequestOutput, SampledLogprobs
from jaxinfer.sampling_params import SamplingParams

PAD, BOS, EOS = 0, 1, 2
_OFFSET = 3
GREEDY_TEXT = "the quick brown fox jumps over the lazy dog. "


class FakeTokenizer:
    vocab_size = 256 + _OFFSET
    eos_token_ids = (EOS,)
    bos_token_id = BOS

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b + _OFFSET for b in text.encode()]

    def encode_chat_prompt(self, text: str) -> list[int]:
        return self.encode(text, add_special_tokens=False)

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        data = bytes(t - _OFFSET for t in token_ids if t >= _OFFSET)
        specials = "" if skip_special_tokens else "".join(
            {PAD: "<pad>", BOS: "<s>", EOS: "</s>"}[t] for t in token_ids if t < _OFFSET)
        return data.decode("utf-8", errors="replace") + specials

    def token_bytes(self, token_id: int) -> bytes:
        if token_id < _OFFSET:
            return self.decode([token_id], skip_special_tokens=False).encode()
        return bytes([token_id - _OFFSET])

    def render_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        for m in messages:
            if m["role"] == "tool":
                raise ValueError("this template has no tool role")
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> list[int]:
        return self.encode_chat_prompt(self.render_chat_template(messages, add_generation_prompt))


@dataclasses.dataclass
class _Req:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    arrival_time: float
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    num_pages: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text: TextTracker | None = None  # step(detokenize=True) only


class FakeEngine:
    def __init__(self, *, max_model_len: int = 256, max_num_seqs: int = 8, page_size: int = 4,
                 num_pages: int = 1024, step_delay_s: float = 0.0, warmup_delay_s: float = 0.0):
        self.tokenizer = FakeTokenizer()
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.page_size = page_size
        self.num_pages = num_pages
        self.step_delay_s = step_delay_s
        self.warmup_delay_s = warmup_delay_s
        self.warmed_up = False
        self.num_steps = 0
        self.num_finished = 0
        self.fail_steps = 0  # the next `fail_steps` steps raise
        self.aborted_ids: list[str] = []
        self.max_batch_seen = 0
        self._waiting: list[_Req] = []
        self._running: list[_Req] = []
        self._used_pages = 0
        self._thread_id: int | None = None
        self.added: dict[str, dict] = {}  # request id -> how it was queued (priority, background)

    # -- the contract ---------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return FakeTokenizer.vocab_size

    def warmup(self) -> None:
        self._check_thread()
        time.sleep(self.warmup_delay_s)
        self.warmed_up = True

    def add_request(self, request_id, prompt, params=None, priority=0, background=False):
        self._check_thread()
        self.added[request_id] = {"priority": priority, "background": background}
        params = params or SamplingParams()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt must not be empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt is {len(ids)} tokens long; the context limit is "
                             f"{self.max_model_len} tokens")
        if any(r.request_id == request_id for r in self._waiting + self._running):
            raise ValueError(f"request_id={request_id!r} is already in use")
        seed = params.seed if params.seed is not None else random.getrandbits(32)
        self._waiting.append(_Req(request_id, ids, params, seed, time.monotonic()))

    def abort_request(self, request_id):
        self._check_thread()
        self.aborted_ids.append(request_id)
        for queue in (self._waiting, self._running):
            for r in list(queue):
                if r.request_id == request_id:
                    queue.remove(r)
                    self._free(r)

    def finish_request(self, request_id, reason="stop", stop_reason=None):
        self._check_thread()
        for queue in (self._waiting, self._running):
            for r in list(queue):
                if r.request_id == request_id:
                    r.finish_reason, r.stop_reason = reason, stop_reason
                    queue.remove(r)
                    self._free(r)

    def has_unfinished_requests(self) -> bool:
        self._check_thread()
        return bool(self._waiting or self._running)

    def step(self, detokenize: bool = True) -> list[RequestOutput]:
        self._check_thread()
        if self.fail_steps > 0:
            self.fail_steps -= 1
            raise RuntimeError("injected step failure")
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        while self._waiting and len(self._running) < self.max_num_seqs:
            r = self._waiting.pop(0)
            self._running.append(r)
        self.max_batch_seen = max(self.max_batch_seen, len(self._running))
        self.num_steps += 1
        outputs = []
        for r in list(self._running):
            self._decode_one(r)
            outputs.append(self._output(r, detokenize))
            if r.finish_reason is not None:
                self._running.remove(r)
                self._free(r)
                self.num_finished += 1
        return outputs

    @property
    def metrics(self) -> EngineMetrics:
        self._check_thread()
        num_running = len(self._running)
        return EngineMetrics(
            num_steps=self.num_steps, num_running=num_running, num_waiting=len(self._waiting),
            num_scheduled_seqs=num_running, num_batched_tokens=num_running,
            num_preemptions_total=0, num_finished_total=self.num_finished,
            num_usable_pages=self.num_pages - 1, num_used_pages=self._used_pages,
            num_cached_pages=0, num_evictions_total=0,
            prefix_cache_query_tokens=4, prefix_cache_hit_tokens=1,  # a hit rate of 0.25
            num_live_tokens=0, num_allocated_slots=0, num_compilations=3)

    # -- the fake model -------------------------------------------------------------------------
    def next_token(self, r: _Req) -> int:
        pos = len(r.prompt_token_ids) + len(r.output_token_ids)
        p = r.params
        if p.temperature == 0:
            ch = GREEDY_TEXT[(sum(r.prompt_token_ids) + len(r.output_token_ids)) % len(GREEDY_TEXT)]
            return ord(ch) + _OFFSET
        rng = random.Random(r.seed * 1_000_003 + pos)  # an integer seed: the same in every run
        return rng.randrange(ord("a"), ord("z") + 1) + _OFFSET

    def _decode_one(self, r: _Req) -> None:
        token = self.next_token(r)
        r.output_token_ids.append(token)
        pages_needed = -(-(len(r.prompt_token_ids) + len(r.output_token_ids)) // self.page_size)
        self._used_pages += pages_needed - r.num_pages
        r.num_pages = pages_needed
        if r.params.logprobs is not None:
            tops = [token] + [t for t in (ord("x") + _OFFSET, ord("y") + _OFFSET) if t != token]
            r.logprobs.append(SampledLogprobs(token, -0.25, tops[:r.params.logprobs],
                                              [-0.25, -1.5, -2.5][:r.params.logprobs]))
        n = len(r.output_token_ids)
        p = r.params
        if n >= p.min_tokens and token in (p.stop_token_ids or []):
            r.finish_reason, r.stop_reason = "stop", token
        if r.finish_reason is None and (
                (p.max_tokens is not None and n >= p.max_tokens)
                or len(r.prompt_token_ids) + n >= self.max_model_len):
            r.finish_reason = "length"

    def _output(self, r: _Req, detokenize: bool) -> RequestOutput:
        completion = CompletionOutput(
            index=0, text="", token_ids=list(r.output_token_ids),
            finish_reason=r.finish_reason, stop_reason=r.stop_reason,
            logprobs=list(r.logprobs) if r.params.logprobs is not None else None)
        metrics = RequestMetrics(r.arrival_time, None, None, None, None, len(r.prompt_token_ids),
                                 len(r.output_token_ids), 0, 0)
        prompt_lps = None
        if r.params.prompt_logprobs is not None:  # token i: logprob -i/10, its own id the top one
            k = r.params.prompt_logprobs
            prompt_lps = [None] + [SampledLogprobs(t, -i / 10, [t][:k], [-i / 10][:k])
                                   for i, t in enumerate(r.prompt_token_ids[1:], 1)]
        out = RequestOutput(r.request_id, None, r.prompt_token_ids, [completion],
                            r.finish_reason is not None, metrics, prompt_logprobs=prompt_lps)
        if not detokenize:
            return out
        if r.text is None:  # as LLMEngine's OutputProcessor: text, and stop strings end it here
            r.text = TextTracker(self.tokenizer, r.prompt_token_ids, r.params)
        out = r.text.apply(out)
        if out.finished and r.finish_reason is None:
            r.finish_reason, r.stop_reason = "stop", r.text.stop_reason
        return out

    def _free(self, r: _Req) -> None:
        self._used_pages -= r.num_pages
        r.num_pages = 0

    def _check_thread(self) -> None:
        me = threading.get_ident()
        if self._thread_id is None:
            self._thread_id = me
        assert self._thread_id == me, "the engine was called from two threads"
