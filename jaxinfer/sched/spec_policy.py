"""SpecPolicy: how many drafts each request may have verified in a step. Host-only (no JAX).

Two rules; the smaller k wins, and the scheduler then caps it by the token budget, the context
limit and max_tokens:

1. Per request, from its measured acceptance. Model each draft as accepted with probability
   `alpha`, independently, so the j-th draft is used with probability alpha**j: it is worth
   verifying while alpha**j >= `spec_min_accept_prob` (its expected gain beats a verification
   slot's cost). So k = the largest j <= K with alpha**j >= spec_min_accept_prob, e.g. at 0.3:
   alpha 0.75 -> 4, 0.6 -> 2, 0.5 -> 1, below 0.3 -> 0. `alpha` is the request's own acceptance:
   a verification of k drafts that accepted a is a accepted trials plus (if a < k) one rejected
   trial; both counts decay by DECAY per verification, so alpha follows the text as it moves
   between copying and free prose. Prior: 3 accepted of 4 trials (0.75, so a new request starts
   at k = 4). A request at k = 0 probes one draft every PROBE_INTERVAL decode steps, so
   one that starts copying later gets speculation back.

2. Per batch: verification is nearly free while a step is latency-bound (small batches) and costs
   full price once it is compute-bound. A step verifies at most `spec_max_batched_tokens` decode
   plus draft tokens, shared evenly among the n requests running or waiting:
   k <= spec_max_batched_tokens // n - 1. At 64: n <= 12 -> k = 4, 16 -> 3, 21 -> 2, 32 -> 1,
   n > 32 -> speculation off. The budget is the device's knee: `LLMEngine.warmup()` times steps
   of 1 .. K + 1 tokens and of each larger token bucket and, unless spec_max_batched_tokens is
   set, takes the largest one whose time stays within KNEE_SLOWDOWN (1.5x) of a one-token step
   (64 until then), but never less
   than min(K, SHARED_DRAFTS) + 1, and for a request alone in the engine never less than K + 1,
   its full verification. Where a step's time grows with its tokens from the start (a small
   CPU), single streams then speculate (rule 1 weighs what it costs) and batches mostly do not:
   two requests share 9 tokens, 3 drafts each, eight none. Where steps stay latency-bound to
   hundreds of tokens (a GPU, a small model) batches speculate too. Requests that share a step
   have at most SHARED_DRAFTS (8) drafts each, and the floor for them stops at SHARED_DRAFTS + 1:
   K = 16 pays for a copy in a single stream (docs/performance.md, "What is left"), but a floor
   of 17 let each of 8 requests verify a draft, at a loss on a 2-core CPU. So batches get what
   they got when K was 8, calibrated or not.

Once the engine has timed its steps (`calibrated`), rule 1 also weighs what the drafts cost: of
the k that rule allows, it takes the one with the most expected tokens per unit of step time,
E(j) / c(j), where E(j) = (1 - alpha**(j + 1)) / (1 - alpha) is what a verification of j drafts
emits (the accepted drafts and the target's own token) and c(j) the measured time of the batch's
step with j drafts each over its time with none; no drafts where no j beats E(0) / c(0) = 1 by
MIN_GAIN (the model of alpha is rough, and a step with drafts costs the host a little more).
Where a verification of 8 drafts costs ~3x a one-token step (float matmuls on a small CPU) a
request at alpha 0.75 then verifies 3 drafts, not 4, and one at 0.5 none (the threshold rule
alone: 1); where it costs ~1x (a GPU) the threshold rule alone decides. A request at k = 0
likewise probes less often where a probe costs more: at most PROBE_OVERHEAD of its steps' time
goes to probes that find nothing.

Prompt lookup also says how long its match is (`NgramProposer.lookup`): how many of the
request's last tokens the earlier text it proposes from repeats. A match of LONG_MATCH tokens or
more is taken for a copy in progress, whose drafts the target keeps or leaves together (it goes
on copying, or departs from the text): such a match may have up to its length - 1 drafts,
whatever alpha's threshold says, and with measured step times the count with the most expected
tokens per unit of step time under that model, E(j) = 1 + alpha j (all j accepted with
probability alpha), again nothing unless it beats a plain step by MIN_GAIN. A shorter match
(a common phrase, often not continued) keeps rules 1 and 2 and at most its length - 1 drafts
(one for a match of one or two tokens).
On spec.py's prompts, a long match's drafts were all accepted ~75% of the time and a 2-token
match's first draft ~50% (docs/performance.md, item 17).

Requests opt in or out with `SamplingParams.spec_decode` (None: the engine's default, which is on
when a speculative method is configured).
"""

from __future__ import annotations

import dataclasses
import math

from jaxinfer.config import EngineConfig
from jaxinfer.request import Request

DECAY = 0.8  # weight of the past per verification step (~5 steps of memory)
DEFAULT_MAX_BATCHED_TOKENS = 64  # rule 2's budget until `calibrated_max_batched_tokens` measures it
KNEE_SLOWDOWN = 1.5  # rule 2's budget: the largest step no slower than this x a one-token step
# The prior, alpha = 0.75 before any verification (decays away like any observation), lives in
# Request's defaults: spec_accept_num = 3.0, spec_accept_den = 4.0.
PROBE_INTERVAL = 8  # decode steps between one-draft probes of a request at k = 0 (at least)
MIN_GAIN = 1.1  # with measured step times: drafts only where they promise this x the tokens/s
PROBE_OVERHEAD = 0.02  # with measured step times: the share of time a fruitless probe may cost
LONG_MATCH = 4  # a prompt-lookup match this long or longer is a copy in progress (see above)
SHARED_DRAFTS = 8  # the most drafts a request has in a step it shares (rule 2; see above)


@dataclasses.dataclass(frozen=True)
class SpecPolicy:
    num_speculative_tokens: int  # K: the most drafts per request per step
    max_batched_tokens: int = 64  # decode + draft tokens per step (rule 2)
    max_tokens_alone: int = 0  # rule 2's budget for a request alone (0: max_batched_tokens)
    min_accept_prob: float = 0.3  # rule 1's threshold on alpha**j
    draft_lookahead: bool = False  # a draft model writes its drafts' K/V in the step: hold pages
    # measured step seconds by tokens per step, ((tokens, seconds), ...) ascending; () unmeasured
    step_seconds: tuple[tuple[int, float], ...] = ()

    @classmethod
    def from_config(cls, ec: EngineConfig) -> "SpecPolicy | None":
        if ec.speculative_method is None:
            return None
        budget = ec.spec_max_batched_tokens
        return cls(num_speculative_tokens=ec.num_speculative_tokens,
                   max_batched_tokens=DEFAULT_MAX_BATCHED_TOKENS if budget is None else budget,
                   min_accept_prob=ec.spec_min_accept_prob,
                   draft_lookahead=ec.speculative_method == "draft")

    # -- rule 1 -----------------------------------------------------------------------------
    @staticmethod
    def acceptance(req: Request) -> float:
        """The request's estimated per-draft acceptance probability alpha."""
        return req.spec_accept_num / req.spec_accept_den

    def num_drafts_for_acceptance(self, alpha: float) -> int:
        big_k, theta = self.num_speculative_tokens, self.min_accept_prob
        if alpha >= 1.0 or theta <= 0.0:
            return big_k
        if alpha <= 0.0 or alpha < theta:
            return 0
        return min(big_k, int(math.floor(math.log(theta) / math.log(alpha) + 1e-9)))

    def step_time(self, num_tokens: int) -> float:
        """Measured seconds of a step of `num_tokens` tokens: the smallest measured step at least
        that large (its own count where that was timed, else the next one timed, such as the
        bucket it is padded to), or the largest one measured."""
        for tokens, seconds in self.step_seconds:
            if tokens >= num_tokens:
                return seconds
        return self.step_seconds[-1][1]

    def num_drafts_for_cost(self, alpha: float, k_max: int, num_requests: int) -> int:
        """The j <= k_max with the most expected tokens per unit of step time for a batch of
        `num_requests` each verifying j drafts, accepted independently, E(j) = (1 - alpha**(j+1))
        / (1 - alpha); 0 where none beats a step without drafts by MIN_GAIN."""
        return self._best_count(
            lambda j: j + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (j + 1)) / (1.0 - alpha),
            k_max, num_requests)

    def num_drafts_for_copy(self, alpha: float, k_max: int, num_requests: int) -> int:
        """num_drafts_for_cost where the drafts are kept or left together, E(j) = 1 + alpha j."""
        return self._best_count(lambda j: 1.0 + min(alpha, 1.0) * j, k_max, num_requests)

    def _best_count(self, emitted, k_max: int, num_requests: int) -> int:
        """The j <= k_max with the most `emitted(j)` tokens per unit of step time; 0 where none
        beats a step without drafts by MIN_GAIN; k_max where no step times are measured."""
        if not self.step_seconds or k_max <= 0:
            return max(k_max, 0)
        base = self.step_time(num_requests)
        best, best_rate = 0, MIN_GAIN
        for j in range(1, k_max + 1):
            rate = emitted(j) * base / self.step_time(num_requests * (j + 1))
            if rate > best_rate:
                best, best_rate = j, rate
        return best

    def probe_interval(self, num_requests: int) -> int:
        """Decode steps between one-draft probes of a request at k = 0: PROBE_INTERVAL, or more
        where a probe's step costs more than PROBE_OVERHEAD of a plain step per step waited."""
        if not self.step_seconds:
            return PROBE_INTERVAL
        extra = self.step_time(num_requests + 1) / self.step_time(num_requests) - 1.0
        return max(PROBE_INTERVAL, math.ceil(extra / PROBE_OVERHEAD))

    def observe(self, req: Request, num_draft: int, num_accepted: int) -> None:
        """After a decode step of a speculating request: `num_draft` verified, `num_accepted` kept."""
        if num_draft == 0:
            req.spec_idle_steps += 1
            return
        trials = num_accepted + (1 if num_accepted < num_draft else 0)
        req.spec_accept_num = DECAY * req.spec_accept_num + num_accepted
        req.spec_accept_den = DECAY * req.spec_accept_den + trials
        req.spec_idle_steps = 0

    @staticmethod
    def calibrated_max_batched_tokens(step_seconds: dict[int, float]) -> int:
        """Rule 2's budget from measured step times {tokens per step: seconds}: the largest step
        whose time stays within KNEE_SLOWDOWN x the smallest step's (latency-bound up to there)."""
        base = step_seconds[min(step_seconds)]
        return max(t for t, s in step_seconds.items() if s <= KNEE_SLOWDOWN * base)

    def calibrated(self, step_seconds: dict[int, float]) -> "SpecPolicy":
        """This policy with rule 2's budget from measured step times: the knee, but never less
        than min(K, SHARED_DRAFTS) + 1, and for a request alone never less than K + 1, so a
        single stream may always verify its K drafts (rule 1 still decides by acceptance and
        cost). Where a step's time grows from its first token (a CPU) the knee alone left one
        draft, though 4 drafts at ~2x a one-token step's cost still pay on copy-heavy text
        (docs/performance.md, the speculation table)."""
        knee = self.calibrated_max_batched_tokens(step_seconds)
        big_k = self.num_speculative_tokens
        return dataclasses.replace(self,
                                   max_batched_tokens=max(knee, min(big_k, SHARED_DRAFTS) + 1),
                                   max_tokens_alone=max(knee, big_k + 1),
                                   step_seconds=tuple(sorted(step_seconds.items())))

    # -- both rules -------------------------------------------------------------------------
    def max_drafts_for_batch(self, num_requests: int) -> int:
        budget = self.max_batched_tokens
        if num_requests <= 1 and self.max_tokens_alone > 0:
            budget = self.max_tokens_alone
        return max(0, budget // max(num_requests, 1) - 1)

    def max_drafts(self, req: Request, num_requests: int) -> int:
        """The most drafts `req` may have with `num_requests` running or waiting, whatever its
        match (rule 2 and K, SHARED_DRAFTS where others share the step; 0 where it does not
        speculate)."""
        if not req.spec_enabled:
            return 0
        big_k = self.num_speculative_tokens
        if num_requests > 1:
            big_k = min(big_k, SHARED_DRAFTS)
        return min(big_k, self.max_drafts_for_batch(num_requests))

    def num_drafts(self, req: Request, num_requests: int, match_len: int | None = None) -> int:
        """Drafts to propose for `req` now, with `num_requests` running or waiting; `match_len`:
        the length of the prompt-lookup match the drafts continue (None: a draft model's)."""
        k_batch = self.max_drafts(req, num_requests)
        alpha = self.acceptance(req)
        if match_len is not None and match_len >= LONG_MATCH:
            return self.num_drafts_for_copy(alpha, min(k_batch, match_len - 1), num_requests)
        k = min(k_batch, self.num_drafts_for_acceptance(alpha))
        k = self.num_drafts_for_cost(alpha, k, num_requests)
        if k == 0 and k_batch > 0 and req.spec_idle_steps >= self.probe_interval(num_requests):
            k = 1
        return k if match_len is None else min(k, max(match_len - 1, 1))
