"""SamplingParams: how one request is sampled and when it stops. Validated at construction.

Host-only (no JAX). One instance may be shared by many requests, so nothing here is per-request
state: a request's resolved seed lives on the `Request`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

MAX_LOGPROBS = 20
DEFAULT_MAX_TOKENS = 16  # output tokens when a request names no limit (OpenAI's completions default)
MAX_LOGIT_BIAS = 100.0


@dataclasses.dataclass(frozen=True)
class StructuredOutputs:
    """One output constraint (vLLM's names); exactly one field is set. The engine compiles it to a
    grammar (jaxinfer/structured/) and masks each step's logits to the tokens it allows.

    json: a JSON schema (dict, or its JSON text); regex: the whole output fullmatches it (Rust
    regex syntax); choice: the output is one of these strings; grammar: a Lark (or GBNF) grammar;
    json_object: any JSON object."""

    json: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self):
        given = [f.name for f in dataclasses.fields(self)
                 if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, grammar, "
                             f"json_object; got {given or 'none'}")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"structured_outputs.json={self.json!r} must be a JSON schema "
                                 "(an object)")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{name}={v!r} must be a non-empty string")
        if self.choice is not None:
            if (isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple))
                    or not self.choice or not all(isinstance(c, str) for c in self.choice)):
                raise ValueError(f"structured_outputs.choice={self.choice!r} must be a non-empty "
                                 "list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object={self.json_object!r} must be a bool")

    def kind_and_text(self) -> tuple[str, str]:
        """(kind, text): the constraint as llguidance's `grammar_from` takes it (the cache key)."""
        if self.json is not None:
            text = self.json if isinstance(self.json, str) else json.dumps(self.json, sort_keys=True)
            return "json", text
        if self.json_object:
            return "json", '{"type": "object"}'
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(list(self.choice))
        return "grammar", self.grammar


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclasses.dataclass
class SamplingParams:
    n: int = 1  # completions per prompt (the engine fans them out into child requests)
    best_of: int | None = None  # >= n; kept for API compatibility, treated as n
    max_tokens: int | None = DEFAULT_MAX_TOKENS  # None: up to the context limit
    min_tokens: int = 0  # EOS / stop_token_ids do not stop before this many output tokens
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0  # 1.0: off
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0  # 0.0: off
    seed: int | None = None  # None: a random seed is drawn when the request is added
    stop: str | list[str] | None = None  # stop strings (checked by the engine after detokenizing)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    repetition_penalty: float = 1.0  # > 0; 1.0: off
    logprobs: int | None = None  # None: none; k: the sampled token's logprob + top k
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's logprob + top k
    #   (computes the whole prompt: no prefix-cache hits for the part not yet scored)
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100]
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spec_decode: bool | None = None  # None: engine default; False: never speculate for this one
    structured_outputs: StructuredOutputs | None = None  # constrain the output (a grammar)

    def __post_init__(self):
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputs):
            raise ValueError(f"structured_outputs={self.structured_outputs!r} must be a "
                             "StructuredOutputs or None")
        self.stop = _normalize_stop(self.stop)
        self.stop_token_ids = _normalize_token_ids("stop_token_ids", self.stop_token_ids)
        self.logit_bias = _normalize_logit_bias(self.logit_bias)
        self._check_counts()
        self._check_sampling()
        self._check_penalties()
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")
        if self.spec_decode is not None and not isinstance(self.spec_decode, bool):
            raise ValueError(f"spec_decode={self.spec_decode!r} must be a bool or None")

    def _check_counts(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n={self.n!r} must be an integer >= 1")
        if self.best_of is not None and (not _is_int(self.best_of) or self.best_of < self.n):
            raise ValueError(f"best_of={self.best_of!r} must be an integer >= n={self.n}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an integer >= 1 or None")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens={self.min_tokens!r} must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}")
        if self.logprobs is not None and (
                not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs={self.logprobs!r} must be None or in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and (
                not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs={self.prompt_logprobs!r} must be None or in "
                             f"[0, {MAX_LOGPROBS}]")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed={self.seed!r} must be an integer or None")

    def _check_sampling(self) -> None:
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature!r} must be a finite number >= 0")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k!r} must be -1 or 0 (off) or an integer >= 1")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p={self.min_p!r} must be in [0, 1]")

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name}={v!r} must be in [-2, 2]")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty!r} must be > 0")

    # -- derived views ----------------------------------------------------------------------
    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def stop_list(self) -> list[str]:
        return list(self.stop)


def _normalize_stop(stop) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise ValueError(f"stop={stop!r} must be a string or a list of strings")
    if any(s == "" for s in stop):
        raise ValueError(f"stop={stop!r} must not contain an empty string")
    return list(stop)


def _normalize_token_ids(name: str, ids) -> list[int]:
    if ids is None:
        return []
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise ValueError(f"{name}={ids!r} must be a list of token ids")
    ids = list(ids)
    if not all(_is_int(t) and t >= 0 for t in ids):
        raise ValueError(f"{name}={ids!r} must contain non-negative integers")
    return ids


def _normalize_logit_bias(bias) -> dict[int, float] | None:
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias={bias!r} must be a dict of token id -> bias")
    out = {}
    for k, v in bias.items():
        # an int, or (JSON bodies, the OpenAI API) a string of one; never a float's truncation
        if not (_is_int(k) or (isinstance(k, str) and k.strip().lstrip("+-").isdecimal())):
            raise ValueError(f"logit_bias key {k!r} must be a token id")
        token_id = int(k)
        if token_id < 0:
            raise ValueError(f"logit_bias key {k!r} must be a non-negative token id")
        if not _is_number(v) or not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias[{token_id}]={v!r} must be in [-100, 100]")
        out[token_id] = float(v)
    return out
