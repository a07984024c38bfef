"""Frozen configs: ModelConfig (from an HF config.json or GGUF metadata) and EngineConfig."""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import types
import typing
from typing import Any, Literal

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


_HF_ARCH_TO_NAME = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style rope scaling ("llama3"); `linear` is also accepted."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama" | "mistral" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    sliding_window: int | None = None  # a token sees itself and the sliding_window - 1 before it
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Per-frequency divisors of the rotary inverse frequencies (f32[head_dim // 2]), as GGUF files of
    # Llama 3.1+ store them (the `rope_freqs` tensor) instead of rope-scaling metadata.
    rope_freq_factors: tuple[float, ...] | None = None

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture={self.architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (rotary embedding)")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window={self.sliding_window} must be positive or None")
        if self.rope_scaling is not None and self.rope_scaling.rope_type not in ("llama3", "linear"):
            raise ValueError(
                f"rope_scaling.rope_type={self.rope_scaling.rope_type!r} must be llama3 or linear")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ValueError(
                f"len(rope_freq_factors)={len(self.rope_freq_factors)} must be head_dim // 2 "
                f"= {self.head_dim // 2}")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able fields (what `from_dict` reads back)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """The inverse of `to_dict` (after a JSON round trip: lists back to tuples)."""
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        if d.get("rope_freq_factors") is not None:
            d["rope_freq_factors"] = tuple(d["rope_freq_factors"])
        return cls(**d)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """From the dict of an HF config.json (transformers 4 or 5 layout)."""
        try:
            return cls._from_hf_dict(d)
        except KeyError as e:
            raise ValueError(f"HF config is missing the key {e.args[0]!r}") from None

    @classmethod
    def _from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        archs = d.get("architectures") or []
        arch = None
        for a in archs:
            if a in _HF_ARCH_TO_NAME:
                arch = _HF_ARCH_TO_NAME[a]
        if arch is None:
            model_type = d.get("model_type")
            if model_type in SUPPORTED_ARCHITECTURES:
                arch = model_type
            else:
                name = archs[0] if archs else model_type
                raise ValueError(
                    f"architecture={name!r} is not supported; "
                    f"supported: {', '.join(_HF_ARCH_TO_NAME)}"
                )
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={d['hidden_act']!r} is not supported (only silu)")
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported")
        num_heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // num_heads
        # transformers 4: rope_theta + rope_scaling; transformers 5: rope_parameters holds both
        rope_parameters = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
        rs = d.get("rope_scaling") or rope_parameters
        rope_scaling = None
        rope_theta = d.get("rope_theta")
        if rope_theta is None:
            rope_theta = rope_parameters.get("rope_theta")
        if rs:
            rtype = rs.get("rope_type") or rs.get("type")
            if rtype in ("llama3", "linear"):
                rope_scaling = RopeScaling(
                    rope_type=rtype,
                    factor=float(rs.get("factor", 1.0)),
                    low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
                    high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
                    original_max_position_embeddings=int(
                        rs.get("original_max_position_embeddings", 8192)),
                )
            elif rtype not in (None, "default"):
                raise ValueError(f"rope_scaling type {rtype!r} is not supported")
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        sliding = d.get("sliding_window") if d.get("use_sliding_window", arch == "mistral") else None
        layer_types = set(d.get("layer_types") or ())
        if sliding and layer_types == {"full_attention"}:
            sliding = None  # Qwen2: no layer past max_window_layers, so none slides
        if sliding and len(layer_types) > 1:
            # Qwen2 with use_sliding_window: only the layers past max_window_layers slide.
            raise ValueError(
                "a sliding window on only some layers (layer_types mixes full and sliding "
                "attention) is not supported")
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", arch == "qwen2")),
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> "ModelConfig":
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise ValueError(f"model directory {str(path)!r} has no config.json")
        with open(cfg_path) as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{cfg_path!r} is not valid JSON: {e}") from None
        return cls.from_hf_dict(d)


# Kernels: pallas (GPU), cpu (C++ kernels for the CPU), xla (plain jnp, everywhere); auto picks
# pallas on a GPU and cpu on a CPU where those build (ops.resolve_backend).
Backend = Literal["auto", "xla", "pallas", "cpu"]
DType = Literal["float32", "bfloat16", "float16"]
KVCacheDType = Literal["float32", "bfloat16", "float16", "int8"]
Quantization = Literal["int8", "int4"]
# num_speculative_tokens when unset: n-gram drafts (docs/performance.md, the speculation table;
# 16 since a copy's long matches fill them: "What is left"), a draft model's drafts
DEFAULT_NGRAM_DRAFTS = 16
DEFAULT_MODEL_DRAFTS = 4


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine settings. Frozen: it is passed to jitted functions as a static argument.

    One line per setting: its name, type, default and a comment that is the setting's help text
    (the command-line flags are generated from this class; see jaxinfer/config_args.py). A
    Literal type lists the allowed values, and construction refuses any other with ValueError.
    """

    page_size: int = 16  # tokens per KV page (a power of two)
    num_pages: int | None = None  # KV pages in the pool (default: from kv_memory_fraction)
    # Of the free device memory after the weights are loaded (default: 0.85 on an accelerator;
    # on the CPU 0.15 of available RAM, since the KV pool is allocated up front)
    kv_memory_fraction: float | None = None
    max_num_seqs: int = 64  # sequences in one step at most
    max_num_batched_tokens: int = 512  # tokens in one step at most (prefill chunks included)
    max_model_len: int | None = None  # context length (default: the model's)
    dtype: DType = "float32"  # weights and activations
    kv_cache_dtype: KVCacheDType | None = None  # KV cache (default: dtype); int8 is ~half of bf16
    attention_backend: Backend = "auto"  # kernels: pallas on a GPU, cpu (C++) on a CPU when auto
    enable_prefix_caching: bool = True  # reuse the KV pages of prompts seen before
    scheduling: Literal["continuous", "static"] = "continuous"  # batching
    # fcfs, or priority (a lower `priority` runs first and may preempt)
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    # sequences of a step that background requests (batch lines, service_tier "flex") may use
    # while interactive requests are in the engine (with none, they may use them all)
    background_max_num_seqs: int = 1
    # tokens of a step that background requests may use while interactive requests are in the
    # engine (their prompts then go in chunks this small)
    background_max_num_batched_tokens: int = 16
    # seconds the background share stays capped after the last interactive request left
    background_linger_s: float = 1.0
    # schedule each step while the one before it runs, so the host's work hides behind the
    # device's (steps whose tokens decide the next one wait: drafts, grammars, penalties);
    # auto: always on an accelerator, on a CPU (its cores run the step too) after small steps only
    async_scheduling: Literal["auto", "on", "off"] = "auto"
    # weights: none: every weight in dtype; auto: as none, and on a CPU a GGUF file's Q8_0/Q4_0/
    # Q4_1 tensors also as stored, read by the steps of a few rows (faster decode, the same
    # weights); int8/int4: quantized (a GGUF tensor of that kind kept as stored)
    quantization: Literal["auto", "none", "int8", "int4"] = "auto"
    quant_group_size: Literal[32, 64, 128] = 32  # int4: rows of K per scale
    # also quantize the LM head / tied embeddings (int8, or int4 with GPTQ)
    quantize_lm_head: bool = False
    # CPU kernels: multiply the quantized weights by x rounded to int8 per group of K (integer
    # dot products, as llama.cpp does): a few rows cost little more than one, at a small cost in
    # quality (docs/quantization.md has the perplexity). off: x stays float32; on: an error
    # where it cannot apply (float weights, another backend); auto: on where quantized weights
    # run on the CPU kernels of a CPU with AVX-512 VNNI, or AVX2 without AVX-512 (where the
    # int8 kernel is the faster one: cpu_kernels.quant_matmul.int8_activations_fast), off
    # elsewhere. True / False: on / off.
    int8_activations: Literal["off", "on", "auto"] = "off"
    load_format: Literal["auto", "dummy"] = "auto"  # dummy: random weights of the model's shapes
    seed: int = 0  # seeds of requests that bring none
    # Speculative decoding (jaxinfer/runtime/spec_decode.py; the policy in jaxinfer/sched/spec_policy.py)
    speculative_method: Literal["ngram", "draft"] | None = None  # ngram: prompt lookup
    # the most drafts verified per request per step; default 16 for ngram (lookup drafts are free,
    # and a copy's long matches fill them), 4 for a draft model (a step of its own each)
    num_speculative_tokens: int | None = None
    ngram_min: int = 2  # n-gram prompt lookup tries n = ngram_max down to ngram_min
    ngram_max: int = 4  # see ngram_min
    draft_model: str | None = None  # speculative_method draft: a model sharing the tokenizer
    draft_quantization: Quantization | None = None  # weights of the draft model (default: auto)
    # decode + draft tokens one step may verify (default: measured at warm-up: the largest step
    # whose time stays within 1.5x a one-token step)
    spec_max_batched_tokens: int | None = None
    spec_min_accept_prob: float = 0.3  # the j-th draft is proposed while alpha**j >= this
    # tensor parallelism (docs/scale_out.md): devices the weights and KV heads are split over
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1  # engine replicas on disjoint device groups, each its own KV pool
    # several processes (hosts) as one engine: host:port of process 0 (default: the
    # JAXINFER_COORDINATOR_ADDRESS environment variable; docs/scale_out.md)
    coordinator_address: str | None = None
    num_processes: int | None = None  # processes in the job (default: JAXINFER_NUM_PROCESSES, 1)
    process_id: int | None = None  # this process, 0 leads (default: JAXINFER_PROCESS_ID, 0)

    def __post_init__(self):
        if isinstance(self.int8_activations, bool):
            object.__setattr__(self, "int8_activations", "on" if self.int8_activations else "off")
        hints = typing.get_type_hints(type(self))
        _check_choices(self, hints)
        _check_types(self, hints)
        if self.page_size <= 0 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size={self.page_size} must be a positive power of two")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages={self.num_pages} must be at least 2 (page 0 is reserved)")
        if self.kv_memory_fraction is not None and not 0.0 < self.kv_memory_fraction <= 1.0:
            raise ValueError(f"kv_memory_fraction={self.kv_memory_fraction} must be in (0, 1]")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be positive")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be positive")
        if self.background_max_num_seqs <= 0 or self.background_max_num_batched_tokens <= 0:
            raise ValueError(f"background_max_num_seqs={self.background_max_num_seqs} and "
                             f"background_max_num_batched_tokens="
                             f"{self.background_max_num_batched_tokens} must be positive")
        if self.background_linger_s < 0:
            raise ValueError(f"background_linger_s={self.background_linger_s} must be >= 0")
        if self.num_speculative_tokens is None:
            object.__setattr__(self, "num_speculative_tokens",
                               DEFAULT_NGRAM_DRAFTS if self.speculative_method == "ngram"
                               else DEFAULT_MODEL_DRAFTS)
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens} must be in [1, 16]")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"ngram_min={self.ngram_min} and ngram_max={self.ngram_max} must "
                             "satisfy 1 <= ngram_min <= ngram_max")
        if self.speculative_method == "draft" and not self.draft_model:
            raise ValueError("speculative_method='draft' needs draft_model (a path or model name)")
        if self.spec_max_batched_tokens is not None and self.spec_max_batched_tokens < 0:
            raise ValueError(f"spec_max_batched_tokens={self.spec_max_batched_tokens} must be >= 0")
        if not 0.0 <= self.spec_min_accept_prob <= 1.0:
            raise ValueError(f"spec_min_accept_prob={self.spec_min_accept_prob} must be in [0, 1]")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} must be at least 1")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size={self.data_parallel_size} must be at least 1")
        if self.tensor_parallel_size > 1 and self.speculative_method == "draft":
            raise ValueError("speculative_method='draft' is not supported with "
                             f"tensor_parallel_size={self.tensor_parallel_size} (ngram is)")


def literal_choices(annotation) -> tuple | None:
    """The allowed values of a `Literal[...]` or `Literal[...] | None` annotation (None included
    when optional), else None."""
    if typing.get_origin(annotation) is Literal:
        return typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        choices = []
        for arg in typing.get_args(annotation):
            inner = literal_choices(arg) if arg is not type(None) else (None,)
            if inner is None:
                return None
            choices.extend(inner)
        return tuple(choices)
    return None


def _check_types(config, hints: dict[str, Any]) -> None:
    """ValueError naming the field when an int, float, bool or str field (or one of those or
    None) holds a value of another type: a bool is no int, a float no int (2.5 pages), an int
    is a float, and a float must be finite. Literal fields are `_check_choices`'s."""
    for field in dataclasses.fields(config):
        annotation = hints[field.name]
        if literal_choices(annotation) is not None:
            continue
        members = set(typing.get_args(annotation)) if isinstance(annotation, types.UnionType) \
            else {annotation}
        value = getattr(config, field.name)
        if value is None and type(None) in members:
            continue
        kinds = members - {type(None)}
        if len(kinds) != 1 or not kinds <= {int, float, bool, str}:
            continue  # another type: its own checks
        (kind,) = kinds
        ok = {int: isinstance(value, numbers.Integral) and not isinstance(value, bool),
              float: (isinstance(value, numbers.Real) and not isinstance(value, bool)
                      and math.isfinite(value)),
              bool: isinstance(value, bool), str: isinstance(value, str)}[kind]
        if not ok:
            what = {int: "an integer", float: "a finite number", bool: "True or False",
                    str: "a string"}[kind]
            raise ValueError(f"{field.name}={value!r} must be {what}"
                             + (" or None" if type(None) in members else ""))


def _check_choices(config, hints: dict[str, Any]) -> None:
    """ValueError naming the field when a Literal-typed field holds another value."""
    for field in dataclasses.fields(config):
        choices = literal_choices(hints[field.name])
        value = getattr(config, field.name)
        if choices is not None and value not in choices:
            names = ", ".join(repr(c) for c in choices)
            raise ValueError(f"{field.name}={value!r} must be one of {names}")
