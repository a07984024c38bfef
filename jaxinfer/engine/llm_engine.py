"""LLMEngine: add_request / abort / step() -> outputs. The whole loop, readable in one sitting."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from typing import Sequence

import jax
import numpy as np

from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.engine.client import StepFailed
from jaxinfer.engine.outputs import OutputProcessor
from jaxinfer.models.loader import load_model, model_source
from jaxinfer.ops.kv_cache import kv_cache_bytes_per_page
from jaxinfer.request import Request, RequestOutput
from jaxinfer.runtime.draft_model import DraftModel, load_draft_model
from jaxinfer.runtime.mesh import engine_mesh, smallest_free_bytes, tp_size
from jaxinfer.runtime.multihost import MultiHostRunner, is_multi_process
from jaxinfer.runtime.runner import (ModelRunner, PendingStep, device_memory_bytes_free,
                                     kv_dtype_of, param_bytes)
from jaxinfer.runtime.sharding import check_tensor_parallel, shard_model
from jaxinfer.runtime.spec_decode import DraftProposer
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.sched.buckets import StepBuckets
from jaxinfer.sched.output import AheadStep, SchedulerOutput
from jaxinfer.sched.scheduler import Scheduler
from jaxinfer.sched.spec_policy import SpecPolicy
from jaxinfer.sched.stats import SchedulerStats
from jaxinfer.sched.step_input import (calibration_step_inputs, make_step_input,
                                      warmup_step_inputs)
from jaxinfer.structured import GrammarCompiler, bitmask_words
from jaxinfer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

CALIBRATION_REPEATS = 3  # timings of each step shape for speculation; the fastest is kept
# async_scheduling="auto" on a CPU: the next step is scheduled while one runs only if that one
# has at most this many tokens and this much attention context (its sequences' lengths summed).
# The host's Python then works on a core the step leaves idle; after a larger step, which keeps
# both cores of a 2-core machine busy, it slows the step down by more than it saves (measured:
# 1.05-1.11x at 1-16 sequences of 32 tokens and 1 of 512, 1.00x at 4 x 512, 0.94x at 16 x 512;
# docs/performance.md).
CPU_AHEAD_MAX_TOKENS = 16
CPU_AHEAD_MAX_CONTEXT = 2048


@dataclasses.dataclass(frozen=True)
class EngineMetrics(SchedulerStats):
    """A snapshot: the scheduler's stats plus the runner's and speculation's counters."""

    num_compilations: int = 0
    compile_seconds: float = 0.0
    num_draft_tokens_total: int = 0
    num_accepted_tokens_total: int = 0
    num_spec_steps_total: int = 0  # verifications of at least one draft
    num_ahead_steps_total: int = 0  # steps scheduled while the one before ran (async_scheduling)

    @property
    def spec_acceptance_rate(self) -> float:
        n = self.num_draft_tokens_total
        return self.num_accepted_tokens_total / n if n else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens emitted per verification (accepted drafts + the target's own token)."""
        n = self.num_spec_steps_total
        return 1.0 + self.num_accepted_tokens_total / n if n else 0.0


class LLMEngine:
    def __init__(self, model: str, *, tokenizer: str | None = None,
                 devices: Sequence[jax.Device] | None = None, **engine_kwargs):
        """`devices`: the group this engine runs on (a data-parallel replica's; default: the
        first tensor_parallel_size devices)."""
        self.engine_config = EngineConfig(**engine_kwargs)
        self.model_config, model_module = load_model(model, self.engine_config)
        check_tensor_parallel(self.model_config, self.engine_config.tensor_parallel_size)
        self.mesh = engine_mesh(self.engine_config.tensor_parallel_size, devices)
        if self.mesh is not None:  # sharded before the KV pool is sized from what is left free
            shard_model(model_module, self.model_config, self.mesh)
        if tokenizer is not None:
            self.tokenizer = Tokenizer.from_source(tokenizer, None)
        elif self.engine_config.load_format == "dummy":
            raise ValueError("load_format='dummy' needs tokenizer= (an HF directory or .gguf file)")
        else:
            source = model_source(model)
            self.tokenizer = Tokenizer.from_source(source.path, source.gguf_file)
        self.max_model_len = self._max_model_len(self.model_config, self.engine_config)
        self.draft_config, draft_module = self._load_draft(model)
        self.num_pages = self._num_pages(model_module)
        draft = None if draft_module is None else DraftModel.create(
            self.draft_config, draft_module, self.engine_config, self.num_pages)
        runner_cls = MultiHostRunner if is_multi_process() and self.mesh is not None else ModelRunner
        self.runner = runner_cls(self.model_config, self.engine_config, model_module, self.num_pages,
                                 draft=draft, mesh=self.mesh)
        del model_module, draft_module
        ec, mc = self.engine_config, self.model_config
        logger.info("model %s: %s, %d layers, context %d; %.1f MiB of weights (%s, quantization "
                    "%s)", model, mc.architecture, mc.num_layers, self.max_model_len,
                    self.weight_bytes() / 2**20, ec.dtype, ec.quantization)
        eos_ids = tuple(self.tokenizer.eos_token_ids) or tuple(self.model_config.eos_token_ids)
        self.proposer = DraftProposer.from_config(self.engine_config)
        self.scheduler = Scheduler(self.engine_config, self.num_pages, self.max_model_len, eos_ids,
                                   policy=self.engine_config.scheduling_policy,
                                   spec_policy=SpecPolicy.from_config(self.engine_config),
                                   may_draft_next=self._may_draft_next)
        self.outputs = OutputProcessor(self.tokenizer)
        self._inflight: tuple[SchedulerOutput, PendingStep] | None = None  # started, not yet seen
        self._host_runs_steps = jax.default_backend() == "cpu"  # the step's cores are the host's
        self.grammars = GrammarCompiler(self.tokenizer.hf_tokenizer, self.model_config.vocab_size,
                                        eos_ids)
        # every step carries an allowed-token bitmask of this many words (all ones unless a
        # request is constrained): one executable a shape serves both kinds of step
        self.bitmask_words = bitmask_words(self.model_config.vocab_size)
        not_pallas = self.runner.attention_backend != "pallas"
        self.buckets = StepBuckets.coarse(self.engine_config, self.max_model_len,
                                          exact_verify=not_pallas, intermediate=not_pallas)
        logger.info(
            "KV cache: %d pages of %d tokens = %d tokens (%.1f MiB)",
            self.num_pages - 1, self.engine_config.page_size,
            (self.num_pages - 1) * self.engine_config.page_size,
            self.num_pages * self._bytes_per_page() / 2**20,
        )

    # -- sizing -----------------------------------------------------------------------------
    @staticmethod
    def _max_model_len(mc: ModelConfig, ec: EngineConfig) -> int:
        if ec.max_model_len is None:
            return mc.max_position_embeddings
        if ec.max_model_len > mc.max_position_embeddings:
            raise ValueError(
                f"max_model_len={ec.max_model_len} exceeds the model's context "
                f"({mc.max_position_embeddings})"
            )
        return ec.max_model_len

    def _bytes_per_page(self) -> int:
        configs = [self.model_config] + ([self.draft_config] if self.draft_config else [])
        return sum(kv_cache_bytes_per_page(c, self.engine_config.page_size,
                                           kv_dtype_of(self.engine_config)) for c in configs)

    def _load_draft(self, model: str):
        """(ModelConfig, module) of the draft model, or (None, None)."""
        ec = self.engine_config
        if ec.speculative_method != "draft":
            return None, None
        target_file = model_source(model).file if ec.load_format != "dummy" else ""
        config, module = load_draft_model(ec, self.model_config,
                                          self.tokenizer.hf_tokenizer.get_vocab(), target_file)
        if config.max_position_embeddings < self.max_model_len:
            raise ValueError(f"draft model context {config.max_position_embeddings} is shorter "
                             f"than max_model_len={self.max_model_len}")
        return config, module

    def _num_pages(self, model_module) -> int:
        ec = self.engine_config
        if ec.num_pages is not None:
            return ec.num_pages
        pages_per_seq = -(-self.max_model_len // ec.page_size)
        wanted = ec.max_num_seqs * pages_per_seq + 1  # enough that memory, not pages, limits
        free = (device_memory_bytes_free() if self.mesh is None
                else smallest_free_bytes(self.mesh.devices.flat))  # each device's share must fit
        if free is None:
            return wanted
        fraction = ec.kv_memory_fraction
        if fraction is None:
            fraction = 0.15 if jax.default_backend() == "cpu" else 0.85
        budget = int(free * fraction)
        by_memory = budget // (self._bytes_per_page() // tp_size(self.mesh))  # per device
        # Rounded down to three significant bits (... 2048, 2560, 3072, 3584, 4096, 5120 ...):
        # free memory drifts from start to start (other processes), and another pool shape misses
        # the compilation caches, i.e. a whole cold warm-up; steps 12-25% apart absorb the drift.
        by_memory = max(_three_significant_bits(by_memory), 2)
        return int(min(wanted, by_memory))

    # -- requests ---------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        background: bool = False,
        arrival_time: float | None = None,
    ) -> None:
        """Queues a request; ValueError naming the problem for one that cannot run. `priority`:
        lower first under the "priority" policy; `background`: the request yields to the others
        (a batch line; sched/scheduler.py)."""
        params = params or SamplingParams()
        if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)):
            raise ValueError(f"priority={priority!r} must be an integer")
        priority = int(priority)
        if not isinstance(background, bool):
            raise ValueError(f"background={background!r} must be True or False")
        if params.n > 1 or (params.best_of or 1) > 1:
            raise ValueError(f"n={params.n}, best_of={params.best_of}: a request of the engine is "
                             "one completion; LLM.generate (or the server) runs n of them")
        if isinstance(prompt, str):
            prompt_text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            prompt_text, token_ids = None, prompt_token_ids(prompt)
            bad = [t for t in token_ids if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise ValueError(
                    f"prompt token ids {bad[:5]} are outside the vocabulary "
                    f"[0, {self.model_config.vocab_size})"
                )
        if not token_ids:
            raise ValueError("prompt must not be empty")
        self._check_vocab_ids(params)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(token_ids)} tokens long; the context limit is "
                f"{self.max_model_len} tokens (prompt + at least 1 generated)"
            )
        if any(r.request_id == request_id for r in self.scheduler.all_requests()):
            raise ValueError(f"request_id={request_id!r} is already in use")
        method = self.engine_config.speculative_method
        if params.spec_decode and method is None:
            raise ValueError("spec_decode=True needs an engine with speculative_method set")
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.grammars.request_grammar(params.structured_outputs)
        # a constrained request speculates with n-gram drafts (cut to what its grammar accepts);
        # a draft model's q is sampled on the device, unmasked: no drafts (runtime/spec_decode.py)
        speculates = method is not None and params.spec_decode is not False and (
            grammar is None or method == "ngram")
        req = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
            priority=priority,
            background=background,
            spec_enabled=speculates,
            grammar=grammar,
        )
        self.scheduler.add_request(req)
        self.outputs.add(req, prompt_text)

    def _check_vocab_ids(self, params: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"stop_token_ids={bad[:5]} are outside the vocabulary [0, {vocab})")
        bad = [t for t in (params.logit_bias or {}) if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, {vocab})")

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort_request(request_id)
        self.outputs.abort(request_id)

    def finish_request(self, request_id: str, reason: str = "stop",
                       stop_reason: str | int | None = None) -> None:
        """Ends a request as finished (e.g. a stop string the caller found); frees its pages."""
        self.scheduler.finish_request(request_id, reason, stop_reason=stop_reason)
        self.outputs.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def spec_policy(self) -> SpecPolicy | None:
        """How many drafts each request gets (the scheduler's; None without speculation)."""
        return self.scheduler.spec_policy

    # -- the step ---------------------------------------------------------------------------
    def step(self, detokenize: bool = True) -> list[RequestOutput]:
        """One scheduling step: runs the batch, returns the updated requests' outputs. With
        `detokenize=False` the outputs carry token ids only (empty text) and stop strings are
        the caller's to check (engine/outputs.py's TextTracker; `finish_request` ends a request).

        With `async_scheduling` the next step is scheduled while this one runs and started as
        soon as this one's tokens are back, before this returns (`Scheduler.schedule_ahead`): the
        host's work (outputs, stops, scheduling, step inputs) overlaps the device's, and the
        next call returns that step's outputs."""
        if self._inflight is None:
            sched_out = self.scheduler.schedule()
            if sched_out.is_empty:
                return []
            try:
                self._start(sched_out, self._step_input(sched_out))
            except Exception as e:  # noqa: BLE001 - a compile error, out of memory, a bug
                raise self._recover(sched_out, e) from e
        (sched_out, pending), self._inflight = self._inflight, None
        ahead = None
        try:
            if self._schedules_ahead(sched_out):
                ahead = self.scheduler.schedule_ahead(sched_out)
                ahead_input = None if ahead is None else self._step_input(ahead.sched_out)
            runner_out = pending.result()
            if ahead is not None:
                ahead.fill_tokens(ahead_input.input_ids, runner_out)
                self._start(ahead.sched_out, ahead_input)
            # drafts follow the count from before the update: the one scheduling ahead decided by
            num_requests = self.scheduler.num_requests
            updated = self.scheduler.update(sched_out, runner_out)
            if self.proposer is not None:
                self.proposer.propose(sched_out, runner_out, updated, self.scheduler, num_requests)
        except Exception as e:  # noqa: BLE001 - an XLA runtime error, out of memory, a bug
            raise self._recover(sched_out, e, ahead) from e
        if detokenize:  # a stop string ends its request now, before the outputs are made
            for request_id, stop in self.outputs.update_text(updated):
                self.scheduler.finish_request(request_id, "stop", stop_reason=stop)
        return self.outputs.process(updated, detokenize=detokenize)

    def _may_draft_next(self, token_ids: list[int]) -> bool:
        """The scheduler's `may_draft_next`: what the proposer the engine has now says."""
        return self.proposer is not None and self.proposer.may_draft_next(token_ids)

    def _schedules_ahead(self, running: SchedulerOutput) -> bool:
        """Whether to schedule the next step while `running` runs (async_scheduling)."""
        mode = self.engine_config.async_scheduling
        if mode != "auto":
            return mode == "on"
        if not self._host_runs_steps:
            return True  # the host's cores are free while the device works
        context = sum(item.kv_len for item in running.scheduled)
        return (running.num_batched_tokens <= CPU_AHEAD_MAX_TOKENS
                and context <= CPU_AHEAD_MAX_CONTEXT)

    def _step_input(self, sched_out: SchedulerOutput):
        return make_step_input(sched_out, self.engine_config, self.max_model_len,
                               buckets=self.buckets, bitmask_words=self.bitmask_words)

    def _start(self, sched_out: SchedulerOutput, step_input) -> None:
        """Starts a step (the device runs it while the host goes on): the in-flight step."""
        if (step_input.input_ids < 0).any():
            raise AssertionError("a step input holds a placeholder token")
        self._inflight = (sched_out, self.runner.dispatch(step_input))

    def _recover(self, sched_out, exc: Exception, ahead: AheadStep | None = None) -> StepFailed:
        """After a failed step: ends the step's requests (their pages freed; also those of the
        step scheduled ahead of it, if any), re-allocates the KV cache if the step consumed it
        (then every running request is recomputed: its K/V went with the cache) and drops the
        prefix cache's unused pages, in case a page the step wrote holds garbage. The engine can
        then step again; the returned StepFailed names the ended requests."""
        items = sched_out.scheduled + ([] if ahead is None else ahead.sched_out.scheduled)
        failed = list(dict.fromkeys(item.request.request_id for item in items))
        logger.error("a step failed (%s: %s): ending its %d requests", type(exc).__name__, exc,
                     len(failed))
        for request_id in failed:
            self.abort_request(request_id)
        if self.runner.restore_caches():
            self.scheduler.recompute_all()
        self.scheduler.reset_prefix_cache()
        return StepFailed(failed, exc)

    def warmup(self) -> None:
        """Compiles (or loads from the executable cache) every shape bucket now, so no request
        waits through a compile, then runs each once (`ModelRunner.check_executables`: one that
        fails is compiled again; the device is known to work).
        Logs its progress (step shapes done / total, seconds) about ten times on the way."""
        t0 = time.perf_counter()
        step_inputs = list(warmup_step_inputs(self.engine_config, self.max_model_len,
                                              buckets=self.buckets,
                                              bitmask_words=self.bitmask_words))
        num_threads = min(4, os.cpu_count() or 1)
        total = len(step_inputs)
        chunk = max(2 * num_threads, -(-total // 10))  # each chunk overlaps on num_threads
        for start in range(0, total, chunk):
            self.runner.compile(step_inputs[start:start + chunk], num_threads=num_threads)
            done = min(start + chunk, total)
            if start == 0:  # all of them must fit, not just the next chunk: fail now, not later
                self.runner.check_room(step_inputs[done:])
            if done < total:
                logger.info("warm-up: %d/%d step shapes (%.1f s)", done, total,
                            time.perf_counter() - t0)
        # each executable runs once (all padding: touches only the null page), so one that a
        # cache returned damaged is compiled again now, not failing requests later
        self.runner.check_executables(step_inputs)
        logger.info("warm-up: %d/%d step shapes, %d executables in %.1f s", total, total,
                    self.runner.num_compilations, time.perf_counter() - t0)
        if self.spec_policy is not None and self.engine_config.spec_max_batched_tokens is None:
            self.calibrate_speculation()

    def calibrate_speculation(self) -> int:
        """Times one (compiled) step of each token count the speculation policy weighs (the
        best of CALIBRATION_REPEATS; `calibration_step_inputs`: a single stream verifying 0 ..
        K drafts, then each larger token bucket full) and gives the times to the policy: its
        budget of decode + draft tokens per step becomes the device's knee
        (sched/spec_policy.py, rule 2), or min(K, SHARED_DRAFTS) + 1 where the knee is lower
        (K + 1 for a request alone: its full verification), and rule 1 weighs drafts by what
        their steps cost. The timed tokens are real to the step (a padded one pays for its
        real rows only on the CPU), though they touch only the null page."""
        seconds: dict[int, float] = {}
        for num_tokens, si in calibration_step_inputs(self.engine_config, self.max_model_len,
                                                      buckets=self.buckets,
                                                      bitmask_words=self.bitmask_words):
            self.runner.execute(si)  # compiled, and caches warm
            best = math.inf
            for _ in range(CALIBRATION_REPEATS):
                t0 = time.perf_counter()
                self.runner.execute(si)
                best = min(best, time.perf_counter() - t0)
            seconds[num_tokens] = best
        self.scheduler.spec_policy = self.spec_policy.calibrated(seconds)
        budget = self.scheduler.spec_policy.max_batched_tokens
        logger.info("speculation: up to %d decode + draft tokens per step (step seconds %s)",
                    budget, {t: round(s, 4) for t, s in sorted(seconds.items())})
        return budget

    @property
    def metrics(self) -> EngineMetrics:
        stats = self.scheduler.stats()
        return EngineMetrics(
            **{f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)},
            num_compilations=self.runner.num_compilations,
            compile_seconds=self.runner.compile_seconds,
            num_draft_tokens_total=self.scheduler.num_draft_tokens_total,
            num_accepted_tokens_total=self.scheduler.num_accepted_tokens_total,
            num_spec_steps_total=self.scheduler.num_spec_steps_total,
            num_ahead_steps_total=self.scheduler.num_ahead_steps,
        )

    def weight_bytes(self) -> int:
        return param_bytes(self.runner.state)


def prompt_token_ids(prompt) -> list[int]:
    """A prompt given as token ids (a sequence or a 1-D array of integers) as a list of ints;
    ValueError naming `prompt` for anything else (floats, strings, bools are not token ids)."""
    if isinstance(prompt, np.ndarray):
        if prompt.ndim != 1 or not np.issubdtype(prompt.dtype, np.integer):
            raise ValueError(f"prompt: an array of token ids must be 1-D of integers, not "
                             f"{prompt.ndim}-D of {prompt.dtype}")
        return prompt.tolist()
    if isinstance(prompt, dict) or not isinstance(prompt, Sequence):
        raise ValueError(f"prompt must be a string or a sequence of token ids, not "
                         f"{type(prompt).__name__}")
    bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, (int, np.integer))]
    if bad:
        raise ValueError(f"prompt token ids must be integers; got {bad[:3]!r}")
    return [int(t) for t in prompt]


def _three_significant_bits(n: int) -> int:
    """`n` rounded down to its three leading binary digits (3926 -> 3584)."""
    shift = max(n.bit_length() - 3, 0)
    return (n >> shift) << shift
