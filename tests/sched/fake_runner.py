"""A model stand-in for scheduler tests (numpy only): a 'KV cache' of token ids and positions.

Each step it writes every new token at its slot, then reads each sequence's whole context back
through the page table and checks it is exactly that request's tokens (so a wrong page, a shared
page overwritten, a bad slot or a wrong position fails at once). The 'sampled' token depends only
on the context and the seed, so a request's output cannot depend on the rest of the batch.
"""

from __future__ import annotations

import numpy as np

from jaxinfer.config import EngineConfig
from jaxinfer.request import Request
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.sched.buckets import StepBuckets
from jaxinfer.sched.output import RunnerOutput
from jaxinfer.sched.scheduler import Scheduler
from jaxinfer.sched.step_input import make_step_input

EOS = 1


def fake_next_token(context: np.ndarray, seed: int, vocab_size: int) -> int:
    weights = 1 + 7919 * np.arange(len(context), dtype=np.int64)
    return int((int(np.dot(context.astype(np.int64), weights)) + 31 * seed) % 1_000_003 % vocab_size)


class FakeRunner:
    def __init__(self, num_pages: int, page_size: int, vocab_size: int = 64):
        self.page_size = page_size
        self.vocab_size = vocab_size
        self.kv_token = np.full(num_pages * page_size, -1, np.int64)
        self.kv_pos = np.full(num_pages * page_size, -1, np.int64)
        self.num_steps = 0

    def execute(self, si, sched_out) -> RunnerOutput:
        ps, n = self.page_size, si.num_rows
        assert np.all(si.slot_mapping[si.num_real_tokens:] < ps), "padding writes outside the null page"
        assert np.all(si.slot_mapping[:si.num_real_tokens] >= ps), "a real token writes the null page"
        self.kv_token[si.slot_mapping] = si.input_ids
        self.kv_pos[si.slot_mapping] = si.positions
        tokens = np.zeros(si.seeds.shape[0], np.int32)
        for s in range(n):
            req = sched_out.scheduled[s].request
            kv_len = int(si.kv_lens[s])
            pos = np.arange(kv_len)
            slots = si.page_indices[s][pos // ps] * ps + pos % ps
            assert np.array_equal(self.kv_pos[slots], pos), f"{req.request_id}: wrong positions"
            assert self.kv_token[slots].tolist() == req.all_token_ids[:kv_len], (
                f"{req.request_id}: context read back differs")
            last = int(si.logits_indices[s])
            assert int(si.positions[last]) == kv_len - 1 and int(si.sample_positions[s]) == kv_len
            tokens[s] = fake_next_token(self.kv_token[slots], int(si.seeds[s]), self.vocab_size)
        self.num_steps += 1
        return RunnerOutput(token_ids=tokens)


def make_config(**kw) -> EngineConfig:
    base = dict(page_size=4, max_num_seqs=4, max_num_batched_tokens=16, enable_prefix_caching=True)
    base.update(kw)
    return EngineConfig(**base)


def make_request(rid: str, prompt, **sp) -> Request:
    sp.setdefault("max_tokens", 8)
    sp.setdefault("seed", 0)
    return Request(request_id=rid, prompt_token_ids=list(prompt), sampling_params=SamplingParams(**sp),
                   arrival_time=0.0)


class Harness:
    """Scheduler + FakeRunner + make_step_input, checking invariants around every step."""

    def __init__(self, num_pages=16, max_model_len=32, eos=(EOS,), vocab_size=64, policy="fcfs",
                 coarse_buckets=False, clock=None, **cfg):
        self.config = make_config(**cfg)
        self.max_model_len = max_model_len
        kw = {} if clock is None else {"clock": clock}
        self.sched = Scheduler(self.config, num_pages, max_model_len, eos, policy=policy, **kw)
        self.runner = FakeRunner(num_pages, self.config.page_size, vocab_size)
        make_buckets = StepBuckets.coarse if coarse_buckets else StepBuckets.from_config
        self.buckets = make_buckets(self.config, max_model_len)
        self.finished: dict[str, Request] = {}
        self.inflight = None  # (SchedulerOutput, StepInput) started, not yet run (step_ahead)

    def add(self, req: Request) -> Request:
        self.sched.add_request(req)
        return req

    def step(self):
        sched_out = self.sched.schedule()
        self.sched.check_invariants()
        if sched_out.is_empty:
            return sched_out, []
        out = self.runner.execute(self._input(sched_out), sched_out)
        return sched_out, self._updated(self.sched.update(sched_out, out))

    def step_ahead(self):
        """The engine's loop with async scheduling: the step after the in-flight one is scheduled
        before the in-flight one runs (here: at once, when its tokens are asked for); its
        placeholders get the sampled tokens, then the in-flight step's update."""
        if self.inflight is None:
            sched_out = self.sched.schedule()
            self.sched.check_invariants()
            if sched_out.is_empty:
                return sched_out, []
            self.inflight = (sched_out, self._input(sched_out))
        (sched_out, si), self.inflight = self.inflight, None
        ahead = self.sched.schedule_ahead(sched_out)
        ahead_si = None if ahead is None else self._input(ahead.sched_out)
        out = self.runner.execute(si, sched_out)
        if ahead is not None:
            assert (ahead_si.input_ids[ahead.token_index] == -1).all()
            ahead.fill_tokens(ahead_si.input_ids, out)
            assert (ahead_si.input_ids >= 0).all(), "a placeholder is left in the step's input"
            self.inflight = (ahead.sched_out, ahead_si)
        changed = self.sched.update(sched_out, out)
        assert not any(r.has_placeholder for r in self.sched.all_requests())
        return sched_out, self._updated(changed)

    def _input(self, sched_out):
        return make_step_input(sched_out, self.config, self.max_model_len, buckets=self.buckets)

    def _updated(self, changed: list[Request]) -> list[Request]:
        """After an update: checks the invariants and records the finished requests."""
        self.sched.check_invariants()
        for r in changed:
            if r.is_finished():
                self.finished[r.request_id] = r
        return changed

    def run(self, max_steps=1000, ahead=False) -> dict[str, Request]:
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                return self.finished
            self.step_ahead() if ahead else self.step()
        raise AssertionError("requests did not finish")


def solo_outputs(prompt, max_model_len=32, **sp) -> list[int]:
    """Output of one request run alone in a roomy pool (the reference)."""
    h = Harness(num_pages=64, max_model_len=max_model_len, max_num_batched_tokens=64)
    h.add(make_request("solo", prompt, **sp))
    return h.run()["solo"].output_token_ids
