"""Where a step's time goes: real engine steps profiled op by op, grouped by the model's named scopes.

    python benchmarks/step_profile.py [--model smollm2-135m] [--attention-backend auto]
                                      [--shapes 1x32,16x512,1x256+8,...] [--prefill 512] [--steps 5]

For each decode shape SxC (S sequences whose contexts are C tokens) the engine is brought to that
state (S prompts of C-1 tokens, prefilled, then decoding), and `--steps` decode steps run under
`jax.profiler`; SxC+K makes them speculative verifications, each sequence's last token and K
drafts in every step (n-gram speculation's step, its drafts fixed and rejected, so each step has
the same shape); `--prefill N` adds one step that prefills an N-token chunk of a fresh prompt. Each
XLA op the trace shows is attributed, through the executables' HLO metadata, to the named scope
it came from (models/llama.py: qkv_proj, attention, kv_write, o_proj, gate_up_proj, down_proj,
lm_head, norm, rope; anything else: sampling, embedding, glue). The table gives the wall time of
a step and each group's share of the op time (ops on XLA's two threads may overlap, so shares are
of the summed op time). Used for the breakdown tables in docs/performance.md.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from cpu_attention import parse_shape  # noqa: E402
from jaxinfer.engine import LLMEngine  # noqa: E402
from jaxinfer.sampling_params import SamplingParams  # noqa: E402

GROUPS = {  # scope -> column
    "qkv_proj": "matmuls", "o_proj": "matmuls", "gate_up_proj": "matmuls",
    "down_proj": "matmuls", "attention": "attention", "kv_write": "kv write",
    "lm_head": "lm head", "norm": "norm+rope", "rope": "norm+rope",
}
COLUMNS = ["matmuls", "attention", "kv write", "lm head", "norm+rope", "other"]
DRAFT_TOKEN = 100  # the drafts of SxC+K shapes (rejected or not, each step has the same shape)
_CONTAINERS = ("ThunkExecutor", "while", "cond", "end:", "SlinkyThreadPool", "call", "$")


def op_scopes(compiled) -> dict[str, str]:
    """HLO instruction name -> its op_name metadata (or, for ops XLA rewrote without metadata,
    the scopes their operands' names carry, e.g. state__layers___3___mlp____gate_up_proj)."""
    names = {}
    for line in compiled.as_text().splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (.*)", line)
        if not m:
            continue
        meta = re.search(r"metadata=\{op_name=\"([^\"]+)\"", m.group(2))
        names.setdefault(m.group(1), meta.group(1) if meta else
                         "/" + "/".join(s for s in GROUPS if s in m.group(2)) + "/")
    return names


def group_of(op_name: str) -> str:
    for scope, group in GROUPS.items():
        if f"/{scope}/" in op_name + "/":
            return group
    return "other"


def profile_steps(engine, num_steps: int) -> tuple[float, dict[str, float]]:
    """(wall seconds per step, {group: op seconds per step}) over `num_steps` engine steps."""
    runner, layouts, inputs = engine.runner, [], []
    dispatch = runner.dispatch

    def recording(step_input):  # which compiled step runs: its buffer layout says
        layouts.append(step_input.pack()[1])
        inputs.append(step_input)
        return dispatch(step_input)

    runner.dispatch = recording
    try:
        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d):
                t0 = time.perf_counter()
                for _ in range(num_steps):
                    engine.step()
                wall = (time.perf_counter() - t0) / num_steps
            trace = json.load(gzip.open(glob.glob(f"{d}/**/*.trace.json.gz",
                                                  recursive=True)[0]))
    finally:
        del runner.dispatch  # back to the method
    if len(set(layouts)) != 1:
        raise RuntimeError(f"the profiled steps ran {len(set(layouts))} executables; expected 1")
    events = trace["traceEvents"]
    xla_threads = {e["tid"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"
                   and "XLA" in e["args"]["name"]}  # the executor's thread and its pool
    ops = [e for e in events if e.get("ph") == "X" and e.get("tid") in xla_threads
           and not e["name"].startswith(_CONTAINERS)]
    compiled = runner._executables.get((layouts[0], runner.flags))
    if compiled is None:  # jit compiled it on first use (no warm-up): the same program again
        compiled = runner._prepare(inputs[0])[0]
    scopes = op_scopes(compiled)
    by_group = collections.Counter()
    for e in ops:
        by_group[group_of(scopes.get(e["name"], ""))] += e["dur"] * 1e-6 / num_steps
    return wall, dict(by_group)


def random_tokens(engine, rng, n: int) -> list[int]:
    """n token ids from 100 .. 30,000 (clear of a vocabulary's special tokens), or from 3 up in a
    smaller vocabulary (the tests' tiny model)."""
    vocab = engine.model_config.vocab_size
    low, high = (100, 30_000) if vocab > 30_000 else (3, vocab)
    return rng.integers(low, high, n).tolist()


def decode_state(engine, num_seqs: int, context: int, tag: str) -> None:
    """`num_seqs` requests whose contexts are `context` tokens, prefilled, about to decode."""
    rng = np.random.default_rng(num_seqs * 7919 + context)
    params = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(f"{tag}-{i}", random_tokens(engine, rng, context - 1), params)
    sched = engine.scheduler
    while sched.waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.running):
        engine.step()
    engine.step()  # every sequence decodes from here


class FixedDrafts:
    """The engine's proposer for SxC+K shapes: K drafts (one fixed token) for every decoding
    request, whatever the speculation policy would give."""

    def __init__(self, num_drafts: int):
        self.num_drafts = num_drafts

    def may_draft_next(self, token_ids) -> bool:  # drafts every step: never scheduled ahead
        return True

    def propose(self, sched_out, runner_out, updated, scheduler, num_requests) -> None:
        for req in updated:
            req.spec_token_ids = [DRAFT_TOKEN] * self.num_drafts


def clear(engine) -> None:
    for r in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        engine.abort_request(r.request_id)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--quantization", default="auto", help="EngineConfig.quantization")
    ap.add_argument("--kv-cache-dtype", default=None, help="EngineConfig.kv_cache_dtype")
    ap.add_argument("--int8-activations", default="off", choices=["off", "on", "auto"],
                    help="EngineConfig.int8_activations")
    ap.add_argument("--shapes", default="1x32,1x512,16x32,16x512,64x32,64x512")
    ap.add_argument("--prefill", type=int, default=512, help="0: no prefill row")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dummy", action="store_true", help="random weights of MODEL's shapes")
    args = ap.parse_args(argv)
    shapes = [parse_shape(s) for s in args.shapes.split(",") if s]
    max_drafts = max([k for _, _, k in shapes] + [0])
    kwargs = dict(max_num_seqs=max([s for s, _, _ in shapes] + [1]),
                  max_num_batched_tokens=max(512, args.prefill), max_model_len=2048,
                  attention_backend=args.attention_backend, quantization=args.quantization,
                  kv_cache_dtype=args.kv_cache_dtype, int8_activations=args.int8_activations,
                  enable_prefix_caching=False)
    if max_drafts:  # the drafts come from FixedDrafts; the budget never cuts them
        kwargs.update(speculative_method="ngram", num_speculative_tokens=max_drafts,
                      spec_max_batched_tokens=kwargs["max_num_batched_tokens"])
    if args.dummy:
        kwargs.update(load_format="dummy", tokenizer=args.model)
    engine = LLMEngine(args.model, **kwargs)
    engine.warmup()
    rows = []
    for num_seqs, context, num_drafts in shapes:
        engine.proposer = FixedDrafts(num_drafts) if max_drafts else None
        decode_state(engine, num_seqs, context, f"d{num_seqs}x{context}+{num_drafts}")
        label = f"decode S={num_seqs} ctx={context}" + (f" +{num_drafts} drafts" if num_drafts
                                                         else "")
        rows.append((label, num_seqs, *profile_steps(engine, args.steps)))
        clear(engine)
    if args.prefill:
        rng = np.random.default_rng(0)
        engine.add_request("prefill", random_tokens(engine, rng, args.prefill + 1),
                           SamplingParams(max_tokens=1))
        rows.append((f"prefill {args.prefill} tokens", args.prefill, *profile_steps(engine, 1)))
        clear(engine)
    print(f"\nStep profile: {args.model}, weights {args.quantization}, int8 activations "
          f"{args.int8_activations}, KV cache "
          f"{args.kv_cache_dtype or 'float32'}, attention backend "
          f"{engine.runner.attention_backend}, "
          f"{jax.devices()[0].device_kind}, {os.cpu_count()} cores")
    print("| step | ms | tok/s | " + " | ".join(COLUMNS) + " |")
    print("|---|---|---|" + "---|" * len(COLUMNS))
    for label, tokens, wall, groups in rows:
        total = sum(groups.values()) or 1.0
        shares = " | ".join(f"{100 * groups.get(c, 0.0) / total:.0f}%" for c in COLUMNS)
        print(f"| {label} | {wall * 1e3:.1f} | {tokens / wall:.0f} | {shares} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
