"""async_scheduling end to end on the tiny Llama: the step after a running one is scheduled and
started before that one's tokens are back, and every request gets exactly the tokens (and text,
and finish reasons) of the synchronous loop."""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest

from jaxinfer import SamplingParams
from jaxinfer.engine.client import StepFailed


@contextlib.contextmanager
def scheduling(llm, mode: str):
    """The same compiled engine with async_scheduling=`mode` (only the engine's loop reads it)."""
    eng = llm.engine
    config = eng.engine_config
    eng.engine_config = dataclasses.replace(config, async_scheduling=mode)
    try:
        yield llm
    finally:
        eng.engine_config = config


def _run(llm, prompts, params):
    before = llm.engine.metrics
    outs = llm.generate(prompts, params, use_tqdm=False)
    after = llm.engine.metrics
    return ([(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason,
              o.outputs[0].stop_reason) for o in outs],
            after.num_ahead_steps_total - before.num_ahead_steps_total,
            after.num_steps - before.num_steps)


def _mixed_params(first_tokens: list[int]) -> list[SamplingParams]:
    """Greedy and seeded, lengths 1-20, a stop token id taken from a greedy run, a stop string,
    logprobs: every way a request ends or returns more than its tokens."""
    params = []
    for i, tok in enumerate(first_tokens):
        kind = i % 5
        if kind == 0:
            params.append(SamplingParams(max_tokens=1 + i, temperature=0, ignore_eos=True))
        elif kind == 1:
            params.append(SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=i,
                                         ignore_eos=True))
        elif kind == 2:
            params.append(SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                         stop_token_ids=[tok]))
        elif kind == 3:
            params.append(SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=["e"]))
        else:
            params.append(SamplingParams(max_tokens=12, temperature=0.7, seed=i, logprobs=2,
                                         ignore_eos=True))
    return params


def test_async_scheduling_gives_the_synchronous_outputs(tiny_llm):
    rng = np.random.default_rng(7)
    prompts = ["The quick brown fox", "Hello there, general"] + [
        rng.integers(3, 300, size=int(n)).tolist() for n in rng.integers(1, 90, size=13)]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with scheduling(tiny_llm, "off"):
        firsts = [o.outputs[0].token_ids[3] for o in tiny_llm.generate(prompts, greedy,
                                                                       use_tqdm=False)]
        params = _mixed_params(firsts)
        expected, sync_ahead, _ = _run(tiny_llm, prompts, params)
    with scheduling(tiny_llm, "on"):
        got, ahead, steps = _run(tiny_llm, prompts, params)
    assert got == expected
    assert sync_ahead == 0 and ahead > steps // 2  # the decode steps, most of them
    finish = {r for _, _, r, _ in got}
    assert finish == {"stop", "length"}
    assert any(isinstance(s, str) for *_, s in got) and any(isinstance(s, int) for *_, s in got)
    eng = tiny_llm.engine
    assert eng.scheduler.pool.num_free_pages == eng.num_pages - 1


def test_a_request_aborted_while_its_next_step_runs(tiny_llm):
    eng = tiny_llm.engine
    sp = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    with scheduling(tiny_llm, "off"):
        (alone,) = tiny_llm.generate([[20, 21, 22]], sp, use_tqdm=False)
    eng.add_request("stays", [20, 21, 22], sp)
    eng.add_request("goes", [5, 6, 7, 8] * 5, sp)
    for _ in range(4):
        eng.step()
    assert eng._inflight is not None  # the next step runs while the host is here
    eng.abort_request("goes")
    last = None
    while eng.has_unfinished_requests():
        last = {o.request_id: o for o in eng.step()}.get("stays", last)
    assert last.outputs[0].token_ids == alone.outputs[0].token_ids
    assert eng.scheduler.pool.num_free_pages == eng.num_pages - 1


def test_a_failed_step_ahead_fails_its_requests_and_the_engine_goes_on(tiny_llm, monkeypatch):
    eng = tiny_llm.engine
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    eng.add_request("a", [30, 31, 32], sp)
    eng.add_request("b", [40, 41, 42, 43], sp)
    eng.step()
    dispatch = eng.runner.dispatch

    def broken(step_input):
        raise RuntimeError("device lost")

    monkeypatch.setattr(eng.runner, "dispatch", broken)
    with pytest.raises(StepFailed) as failed:
        eng.step()  # the step ahead cannot start
    assert sorted(failed.value.request_ids) == ["a", "b"]
    assert not eng.has_unfinished_requests() and eng._inflight is None
    assert eng.scheduler.pool.num_free_pages == eng.num_pages - 1
    assert not any(r.has_placeholder for r in eng.scheduler.all_requests())
    monkeypatch.setattr(eng.runner, "dispatch", dispatch)
    (out,) = tiny_llm.generate([[30, 31, 32]], sp, use_tqdm=False)
    with scheduling(tiny_llm, "off"):
        (ref,) = tiny_llm.generate([[30, 31, 32]], sp, use_tqdm=False)
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_auto_on_a_cpu_schedules_ahead_only_after_small_steps(tiny_llm, monkeypatch):
    """auto on the CPU: a step is scheduled ahead only while the running one has at most
    CPU_AHEAD_MAX_TOKENS tokens and CPU_AHEAD_MAX_CONTEXT tokens of context."""
    from jaxinfer.engine import llm_engine

    eng = tiny_llm.engine
    assert eng.engine_config.async_scheduling == "auto"
    tried = []
    schedule_ahead = eng.scheduler.schedule_ahead

    def spy(running):
        tried.append((running.num_batched_tokens, sum(it.kv_len for it in running.scheduled)))
        return schedule_ahead(running)

    monkeypatch.setattr(eng.scheduler, "schedule_ahead", spy)
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    long_prompts = [[3 + (i * 31 + j) % 290 for j in range(140)] for i in range(16)]

    def small(t, c):
        return t <= llm_engine.CPU_AHEAD_MAX_TOKENS and c <= llm_engine.CPU_AHEAD_MAX_CONTEXT

    steps = eng.metrics.num_steps
    tiny_llm.generate(long_prompts, sp, use_tqdm=False)  # 16 x 140+: more than 2048 of context
    assert all(small(t, c) for t, c in tried)  # the last few, once most have finished
    assert eng.metrics.num_steps - steps >= len(tried) + 8  # the prefills and the 16-wide decodes
    tried.clear()
    with scheduling(tiny_llm, "on"):
        tiny_llm.generate(long_prompts, sp, use_tqdm=False)
    assert any(not small(t, c) for t, c in tried)
    tried.clear()
    tiny_llm.generate([[5, 6, 7, 8] * 10, [9, 10] * 7], sp, use_tqdm=False)
    assert len(tried) >= 3 and all(small(t, c) for t, c in tried)
