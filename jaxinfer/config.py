"""Frozen configs: ModelConfig (from an HF config.json or GGUF metadata) and EngineConfig."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")

_GGUF_ARCHITECTURES = ("llama", "qwen2")  # general.architecture values we read
_REQUIRED = object()

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

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> "ModelConfig":
        """From the metadata of a .gguf file (llama and qwen2 architectures)."""
        from jaxinfer.models.gguf_file import open_gguf  # lazy: gguf is only needed for GGUF

        return cls.from_gguf_reader(open_gguf(path))

    @classmethod
    def from_gguf_reader(cls, reader) -> "ModelConfig":
        """From an open `gguf.GGUFReader` (so a loader parses the file once)."""
        from jaxinfer.models.gguf_file import gguf_field, gguf_tensor_f32

        arch = gguf_field(reader, "general.architecture")
        if arch not in _GGUF_ARCHITECTURES:
            raise ValueError(
                f"architecture={arch!r} is not supported in GGUF files; "
                f"supported: {', '.join(_GGUF_ARCHITECTURES)}")

        def key(name, default=_REQUIRED):
            value = gguf_field(reader, f"{arch}.{name}", None)
            if value is None:
                if default is _REQUIRED:
                    raise ValueError(f"GGUF metadata is missing the key {arch}.{name!r}")
                return default
            return value

        tensor_names = {t.name for t in reader.tensors}
        hidden_size = int(key("embedding_length"))
        num_heads = int(key("attention.head_count"))
        num_kv_heads = key("attention.head_count_kv", num_heads)
        if isinstance(num_kv_heads, list):  # per-layer counts (some converters): must agree
            if len(set(num_kv_heads)) != 1:
                raise ValueError(f"per-layer head_count_kv={num_kv_heads} is not supported")
            num_kv_heads = num_kv_heads[0]
        head_dim = int(key("attention.key_length", hidden_size // num_heads))
        rotary_dim = int(key("rope.dimension_count", head_dim))
        if rotary_dim != head_dim:
            raise ValueError(f"partial rotary embedding ({rotary_dim=}, {head_dim=}) is not supported")

        tokens = reader.fields.get("tokenizer.ggml.tokens")
        if tokens is not None:
            vocab_size = len(tokens.data)
        elif key("vocab_size", None) is not None:
            vocab_size = int(key("vocab_size"))
        else:
            embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
            if embd is None:
                raise ValueError("GGUF file has neither a token list nor token_embd.weight")
            vocab_size = int(embd.shape[-1])

        rope_scaling = None
        scaling_type = key("rope.scaling.type", "none")
        if scaling_type == "linear":
            rope_scaling = RopeScaling(rope_type="linear", factor=float(key("rope.scaling.factor")))
        elif scaling_type not in ("none", None):
            raise ValueError(f"rope scaling type {scaling_type!r} is not supported")
        rope_freq_factors = None
        if "rope_freqs.weight" in tensor_names:
            factors = gguf_tensor_f32(reader, "rope_freqs.weight").reshape(-1)
            rope_freq_factors = tuple(float(x) for x in factors)

        eos_ids = []
        for name in ("eos_token_id", "eot_token_id", "eom_token_id"):
            token_id = gguf_field(reader, f"tokenizer.ggml.{name}", None)
            if token_id is not None and int(token_id) not in eos_ids:
                eos_ids.append(int(token_id))
        bos = gguf_field(reader, "tokenizer.ggml.bos_token_id", None)
        sliding = key("attention.sliding_window", None)
        return cls(
            architecture=arch,
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=int(key("feed_forward_length")),
            num_layers=int(key("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(num_kv_heads),
            head_dim=head_dim,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(key("context_length", 4096)),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=int(bos) if bos is not None else None,
            eos_token_ids=tuple(eos_ids),
            rope_freq_factors=rope_freq_factors,
        )


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine settings. Frozen: it is passed to jitted functions as a static argument."""

    page_size: int = 16
    num_pages: int | None = None  # None: derived from kv_memory_fraction
    # Of the free device memory after the weights are loaded. None: 0.85 on an accelerator; on the
    # CPU 0.15 of available RAM (the KV pool is allocated up front; the host needs the rest).
    kv_memory_fraction: float | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    dtype: str = "float32"  # activations/weights compute dtype: float32 | bfloat16
    kv_cache_dtype: str | None = None  # None: same as dtype; int8: per-token scales (~half of bf16)
    attention_backend: str = "auto"  # auto | xla | pallas
    enable_prefix_caching: bool = True
    scheduling: str = "continuous"  # continuous | static
    scheduling_policy: str = "fcfs"  # fcfs | priority (lower `priority` first; it may preempt)
    quantization: str | None = None  # None | int8 | int4 (weights; see jaxinfer/quant.py)
    quant_group_size: int = 32  # int4: 32 | 64 | 128 rows of K per scale
    quantize_lm_head: bool = False  # also quantize the LM head / tied embedding table
    load_format: str = "auto"  # auto | dummy
    seed: int = 0
    # Speculative decoding (jaxinfer/spec_decode.py; the policy in jaxinfer/sched/spec_policy.py)
    speculative_method: str | None = None  # None | "ngram" (prompt lookup) | "draft" (a model)
    num_speculative_tokens: int = 4  # k: the most drafts verified per request per step
    ngram_min: int = 2  # n-gram prompt lookup tries n = ngram_max .. ngram_min
    ngram_max: int = 4
    draft_model: str | None = None  # "draft": a model sharing the target's tokenizer
    draft_quantization: str | None = None  # None | int8 | int4 (weights of the draft)
    # decode + draft tokens a step may verify (sched/spec_policy.py); None: measured by warmup()
    # (the largest step whose time stays within 1.5x a one-token step), 64 until then
    spec_max_batched_tokens: int | None = None
    spec_min_accept_prob: float = 0.3  # the j-th draft is proposed while alpha**j >= this

    def __post_init__(self):
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
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype={self.dtype!r} must be float32, bfloat16 or float16")
        if self.kv_cache_dtype not in (None, "float32", "bfloat16", "float16", "int8"):
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} must be None, float32, "
                             "bfloat16, float16 or int8")
        if self.attention_backend not in ("auto", "xla", "pallas"):
            raise ValueError(f"attention_backend={self.attention_backend!r} must be auto, xla or pallas")
        if self.scheduling not in ("continuous", "static"):
            raise ValueError(f"scheduling={self.scheduling!r} must be continuous or static")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy={self.scheduling_policy!r} must be fcfs or priority")
        if self.quantization not in (None, "int8", "int4"):
            raise ValueError(f"quantization={self.quantization!r} must be None, int8 or int4")
        if self.quant_group_size not in (32, 64, 128):
            raise ValueError(f"quant_group_size={self.quant_group_size} must be 32, 64 or 128")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format={self.load_format!r} must be auto or dummy")
        self._check_speculative()

    def _check_speculative(self) -> None:
        if self.speculative_method not in (None, "ngram", "draft"):
            raise ValueError(
                f"speculative_method={self.speculative_method!r} must be None, 'ngram' or 'draft'")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens} must be in [1, 16]")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"ngram_min={self.ngram_min} and ngram_max={self.ngram_max} must "
                             "satisfy 1 <= ngram_min <= ngram_max")
        if self.speculative_method == "draft" and not self.draft_model:
            raise ValueError("speculative_method='draft' needs draft_model (a path or model name)")
        if self.draft_quantization not in (None, "int8", "int4"):
            raise ValueError(f"draft_quantization={self.draft_quantization!r} must be None, int8 or int4")
        if self.spec_max_batched_tokens is not None and self.spec_max_batched_tokens < 0:
            raise ValueError(f"spec_max_batched_tokens={self.spec_max_batched_tokens} must be >= 0")
        if not 0.0 <= self.spec_min_accept_prob <= 1.0:
            raise ValueError(f"spec_min_accept_prob={self.spec_min_accept_prob} must be in [0, 1]")
