"""The SamplingParams of a generation request: the OpenAI fields (and vLLM's extensions) mapped
onto SamplingParams, one per sample of `n`. With a seed, sample i gets `seed + i`, so choice i
equals what a request with that seed alone returns."""

from __future__ import annotations

from typing import Any

from jaxinfer.sampling_params import SamplingParams, StructuredOutputs
from serve.errors import APIError, from_value_error
from serve.schemas import SamplingFields

# Fields passed on only when the request sets them (else SamplingParams' own default applies).
_OPTIONAL_FIELDS = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k",
                    "min_p", "repetition_penalty", "min_tokens", "spec_decode")


def sample_params(req: SamplingFields, *, max_tokens: int | None, logprobs: int | None,
                  prompt_logprobs: int | None, vocab_size: int,
                  max_tokens_param: str,
                  constraint: StructuredOutputs | None = None) -> list[SamplingParams]:
    """`req.n` SamplingParams; APIError (400 naming the API's field) for a value SamplingParams
    refuses. `max_tokens_param` is the API's name of max_tokens (max_completion_tokens in chat)."""
    kw: dict[str, Any] = dict(
        n=1, max_tokens=max_tokens, stop=req.stop, stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos, logit_bias=req.logit_bias, logprobs=logprobs,
        prompt_logprobs=prompt_logprobs, skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output, structured_outputs=constraint)
    for name in _OPTIONAL_FIELDS:
        value = getattr(req, name)
        if value is not None:
            kw[name] = value
    if kw.get("top_k", -1) >= vocab_size:
        kw["top_k"] = -1  # keeping every token: the same as off (and no int32 overflow)
    for key in req.logit_bias or ():
        if not key.lstrip("-").isdigit() or not 0 <= int(key) < vocab_size:
            raise APIError(400, f"logit_bias key {key!r} is not a token id in [0, {vocab_size})",
                           param="logit_bias", code="invalid_value")
    try:
        base = SamplingParams(seed=req.seed, **kw)
        return [base if req.seed is None or i == 0 else SamplingParams(seed=req.seed + i, **kw)
                for i in range(req.n)]
    except ValueError as e:
        raise from_value_error(e, {"max_tokens": max_tokens_param}) from None
