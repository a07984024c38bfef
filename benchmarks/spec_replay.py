"""What n-gram speculation can gain here: greedy answers replayed against measured step costs.

    python benchmarks/spec_replay.py [--model smollm2-135m] [--max-tokens 64] [--context 256]
                                     [--k K] [--engine-arg KEY=VALUE ...]

`benchmarks/spec.py` measures speculation's speed-up; this says where it comes from and how far
it could go on this device. It records the greedy answers to spec.py's prompts (speculation off;
greedy speculation emits the same tokens), times real engine steps of one sequence verifying
j = 0 .. K drafts (each a verification executable over --context tokens of context, drafts
rejected so every step has the same shape; the median of --steps), and replays every answer
through the proposer (`NgramProposer`) and the speculation policy (`SpecPolicy`):

- "engine": the policy as the engine runs it, its draft costs from warm-up's calibration (steps
  of real tokens on the null page, the best of 3: engine/llm_engine.py);
- "measured costs": the same policy weighing drafts by the real verifications' costs;
- "oracle": a policy that knows each answer, so it verifies exactly the drafts that will be
  accepted (as many as pay for their step) and never a rejected one: the most any policy can
  gain with these drafts at these step costs.

Each row's speed-up is over the decode phase (tokens after the first, which the prefill gives
with or without speculation), in engine step time (the timed steps include the engine's host
work around the device's). Its engine warms up ~60 executables (~45,000 memory mappings on
Linux, under the default cap of 65,530: docs/performance.md, the last section).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from jaxinfer import LLM, SamplingParams  # noqa: E402
from jaxinfer.request import Request  # noqa: E402
from jaxinfer.runtime.spec_decode import NgramProposer, ngram_drafts  # noqa: E402
from jaxinfer.sched.spec_policy import SpecPolicy  # noqa: E402
from peers import parse_engine_args  # noqa: E402
from spec import COPY_PROMPTS, FREE_PROMPTS, chat_ids  # noqa: E402
from step_profile import FixedDrafts, clear, decode_state  # noqa: E402


_REQUEST_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Request)}


@dataclasses.dataclass
class ReplayRequest:
    """The fields of a Request that the policy reads and updates, from Request's own defaults
    (the policy's prior)."""

    spec_enabled: bool = True
    spec_accept_num: float = _REQUEST_DEFAULTS["spec_accept_num"]
    spec_accept_den: float = _REQUEST_DEFAULTS["spec_accept_den"]
    spec_idle_steps: int = _REQUEST_DEFAULTS["spec_idle_steps"]


@dataclasses.dataclass
class Replay:
    steps: int = 0  # steps after the first token
    verifications: int = 0  # steps that verified at least one draft
    tokens: int = 0  # tokens emitted by those steps
    seconds: float = 0.0  # their step time
    plain_seconds: float = 0.0  # the same tokens, one a step without drafts


def step_costs(llm: LLM, k: int, context: int, steps: int) -> dict[int, float]:
    """Median seconds of an engine step of one sequence at `context` tokens verifying j drafts,
    by tokens in the step (1 + j), j = 0 .. k."""
    engine = llm.engine
    proposer = engine.proposer
    costs = {}
    try:
        for j in range(k + 1):
            engine.proposer = FixedDrafts(j)
            decode_state(engine, 1, context, f"replay-{j}")
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t0)
            costs[1 + j] = statistics.median(times)
            clear(engine)
    finally:
        engine.proposer = proposer
    return costs


def accepted_prefix(drafts: list[int], answer: list[int], t: int) -> int:
    """How many of `drafts`, proposed after `t` tokens of `answer`, greedy verification keeps."""
    n = 0
    while n < len(drafts) and drafts[n] == answer[t + n]:
        n += 1
    return n


class PolicyDrafts:
    """Drafts as the engine gives them (`ngram_drafts`: the proposer's drafts and their match's
    length, cut to the policy's k), the policy told what was accepted."""

    def __init__(self, policy: SpecPolicy, proposer: NgramProposer):
        self.policy, self.proposer = policy, proposer

    def drafts(self, req: ReplayRequest, answer: list[int], tokens: list[int], t: int) -> list[int]:
        return ngram_drafts(self.proposer, self.policy, req, tokens, 1)

    def observe(self, req: ReplayRequest, num_draft: int, num_accepted: int) -> None:
        self.policy.observe(req, num_draft, num_accepted)


class OracleDrafts:
    """The proposer's drafts cut to the count that pays most for its step, knowing the answer:
    the accepted ones at most, never a rejected one."""

    def __init__(self, proposer: NgramProposer, k: int, cost: dict[int, float]):
        self.proposer, self.k, self.cost = proposer, k, cost

    def drafts(self, req: ReplayRequest, answer: list[int], tokens: list[int], t: int) -> list[int]:
        drafts = self.proposer.propose(tokens, self.k)
        kept = accepted_prefix(drafts[:len(answer) - t - 1], answer, t)
        return drafts[:max(range(kept + 1), key=lambda j: (j + 1) / self.cost[j + 1])]

    def observe(self, req: ReplayRequest, num_draft: int, num_accepted: int) -> None:
        pass


def replay(answers, chooser, cost: dict[int, float]) -> Replay:
    """Every (prompt, answer) decoded with the chooser's drafts: each step emits the accepted
    drafts and one token more, and costs the measured step of its tokens."""
    r = Replay()
    for prompt, answer in answers:
        req, t = ReplayRequest(), 1  # the first token comes with the prefill
        while t < len(answer):
            drafts = chooser.drafts(req, answer, prompt + answer[:t], t)
            drafts = drafts[:len(answer) - t - 1]  # the scheduler's room (max_tokens)
            accepted = accepted_prefix(drafts, answer, t)
            chooser.observe(req, len(drafts), accepted)
            r.steps += 1
            if drafts:
                r.verifications += 1
                r.tokens += accepted + 1
            r.seconds += cost[1 + len(drafts)]
            t += accepted + 1
        r.plain_seconds += (len(answer) - 1) * cost[1]
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--context", type=int, default=256, help="context of the timed steps")
    ap.add_argument("--steps", type=int, default=15, help="timed steps per draft count")
    ap.add_argument("--k", type=int, default=None,
                    help="num_speculative_tokens (default: the engine's, 16 for n-gram drafts)")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="an EngineConfig setting (repeatable; values as JSON)")
    args = ap.parse_args(argv)
    common = {**dict(page_size=16, num_pages=2048, max_num_seqs=8, max_num_batched_tokens=256,
                     max_model_len=1024),
              **({} if args.k is None else {"num_speculative_tokens": args.k}),
              **parse_engine_args(args.engine_arg)}  # --engine-arg overrides the settings above
    llm = LLM(args.model, speculative_method="ngram", **common)
    ec = llm.engine.engine_config
    k = ec.num_speculative_tokens
    llm.engine.warmup()  # compiles every shape; calibrates the policy on timed steps
    engine_policy = llm.engine.spec_policy
    off = SamplingParams(max_tokens=args.max_tokens, temperature=0, spec_decode=False)
    workloads = {}
    for name, prompts in (("copy-heavy", COPY_PROMPTS), ("free-form", FREE_PROMPTS)):
        ids = [chat_ids(llm, p) for p in prompts]
        outs = llm.generate(ids, off, use_tqdm=False)
        workloads[name] = [(p, list(o.outputs[0].token_ids)) for p, o in zip(ids, outs)]
    cost = step_costs(llm, k, args.context, args.steps)
    proposer = NgramProposer(ec.ngram_min, ec.ngram_max)
    measured_policy = engine_policy.calibrated(cost)

    print(f"\n{args.model}, one sequence, {args.context} tokens of context, k = {k}, "
          f"{os.cpu_count()} cores; engine step times (median of {args.steps}):")
    print("| tokens in the step | ms | x one token | warm-up's calibration, ms |")
    print("|---|---|---|---|")
    calibration = dict(engine_policy.step_seconds)
    for tokens, seconds in cost.items():
        cal = engine_policy.step_time(tokens) if calibration else float("nan")
        print(f"| {tokens} | {seconds * 1e3:.2f} | {seconds / cost[1]:.2f}x | {cal * 1e3:.2f} |")
    print(f"\nGreedy answers of spec.py's prompts ({args.max_tokens} tokens at most) replayed:")
    print("| workload | policy | steps | verifications | tokens a verification | speed-up |")
    print("|---|---|---|---|---|---|")
    for name, answers in workloads.items():
        for label, chooser in (("engine", PolicyDrafts(engine_policy, proposer)),
                               ("measured costs", PolicyDrafts(measured_policy, proposer)),
                               ("oracle", OracleDrafts(proposer, k, cost))):
            r = replay(answers, chooser, cost)
            per = r.tokens / r.verifications if r.verifications else float("nan")
            print(f"| {name} | {label} | {r.steps} | {r.verifications} | {per:.2f} | "
                  f"{r.plain_seconds / r.seconds:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
