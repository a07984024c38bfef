"""Pre-quantized checkpoints: a quantized model saved with orbax and loaded without re-quantizing.

    save_quantized(model, "out/", source=model_source("smollm2-135m"))  # after quantizing
    config, model = load_quantized("out/")
(`jaxinfer quantize` is `models.loader.quantize_checkpoint`: load quantizing, then save here.)

A checkpoint directory holds:
  quantization.json   format/version, the ModelConfig, the compute dtype, and for every quantized
                      module its layout (bits, group size, symmetry, scale dtype): enough to build
                      the abstract model that orbax restores into
  params/             orbax StandardCheckpointer of the model's pure param dict
  config.json         the source's HF config (written from the ModelConfig for a GGUF source)
  tokenizer files     the source tokenizer, saved by transformers (also for a GGUF source)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer import quant
from jaxinfer.config import ModelConfig
from jaxinfer.models.layers import QuantizedEmbed, QuantizedLinear
from jaxinfer.models.llama import LlamaForCausalLM
from jaxinfer.tokenizer import Tokenizer

FORMAT = "jaxinfer-quantized"
VERSION = 1
MANIFEST = "quantization.json"
PARAMS_DIR = "params"
_HF_FILES = ("config.json", "generation_config.json")

logger = logging.getLogger(__name__)


def is_quantized_checkpoint(path: str | os.PathLike) -> bool:
    return os.path.isfile(os.path.join(os.fspath(path), MANIFEST))


def _module_specs(model) -> dict[str, dict]:
    specs = {}
    for path, module in nnx.iter_modules(model):
        if isinstance(module, (QuantizedLinear, QuantizedEmbed)):
            specs[".".join(str(p) for p in path)] = dict(
                kind="embed" if isinstance(module, QuantizedEmbed) else "linear",
                bits=module.bits, group_size=module.group_size, symmetric=module.mins is None,
                scale_dtype=str(module.scales[...].dtype))
    return specs


def _quantize_like(w, spec: dict) -> quant.QuantizedWeight:
    scale_dtype = jnp.dtype(spec["scale_dtype"])
    if spec["bits"] == 8:
        group_size = None if spec["group_size"] >= w.shape[-2] else spec["group_size"]
        return quant.quantize_int8(w, group_size, scale_dtype)
    return quant.quantize_int4(w, spec["group_size"], spec["symmetric"], scale_dtype)


def _apply_specs(model, specs: dict[str, dict]):
    """Swap the named float modules for quantized ones of the recorded layouts (used abstractly,
    under nnx.eval_shape, to get the restore target)."""
    for dotted, spec in specs.items():
        *parents, name = dotted.split(".")
        parent = model
        for key in parents:
            parent = getattr(parent, key)
        module = getattr(parent, name)
        if spec["kind"] == "embed":
            qw = _quantize_like(module.embedding[...].T, spec)
            setattr(parent, name, QuantizedEmbed(qw, dtype=module.dtype))
        else:
            qw = _quantize_like(module.weight[...], spec)
            setattr(parent, name, QuantizedLinear(qw, module.bias, dtype=module.dtype))
    return model


def _hf_config_dict(mc: ModelConfig) -> dict:
    """An HF config.json for a model that came from a GGUF file (for tools that read one)."""
    arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM"}[mc.architecture]
    d = dict(architectures=[arch], model_type=mc.architecture, vocab_size=mc.vocab_size,
             hidden_size=mc.hidden_size, intermediate_size=mc.intermediate_size,
             num_hidden_layers=mc.num_layers, num_attention_heads=mc.num_heads,
             num_key_value_heads=mc.num_kv_heads, head_dim=mc.head_dim,
             rms_norm_eps=mc.rms_norm_eps, rope_theta=mc.rope_theta,
             max_position_embeddings=mc.max_position_embeddings,
             tie_word_embeddings=mc.tie_word_embeddings, attention_bias=mc.attention_bias,
             bos_token_id=mc.bos_token_id, hidden_act="silu",
             eos_token_id=list(mc.eos_token_ids) if len(mc.eos_token_ids) != 1 else mc.eos_token_ids[0])
    if mc.rope_scaling is not None:
        d["rope_scaling"] = dataclasses.asdict(mc.rope_scaling)
    if mc.sliding_window is not None:
        d.update(sliding_window=mc.sliding_window, use_sliding_window=True)
    return d


def save_quantized(model, out_dir: str | os.PathLike, *, source=None) -> str:
    """Write a quantized model (from load_model with quantization) to `out_dir` (must not exist
    or be empty). `source`: the models.loader.ModelSource it came from, for config and tokenizer."""
    import orbax.checkpoint as ocp  # heavy: only when a checkpoint is saved

    out_dir = os.path.abspath(os.fspath(out_dir))
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise ValueError(f"{out_dir=} must not exist or be empty")
    specs = _module_specs(model)
    if not specs:
        raise ValueError("the model has no quantized modules: load it with quantization set")
    os.makedirs(out_dir, exist_ok=True)
    state = nnx.to_pure_dict(nnx.state(model))
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.join(out_dir, PARAMS_DIR), state)
    checkpointer.wait_until_finished()
    manifest = dict(format=FORMAT, version=VERSION, dtype=str(jnp.dtype(model.dtype)),
                    model_config=model.config.to_dict(), modules=specs)
    with open(os.path.join(out_dir, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    if source is not None:
        _copy_config_and_tokenizer(model.config, source, out_dir)
    return out_dir


def _copy_config_and_tokenizer(mc: ModelConfig, source, out_dir: str) -> None:
    if source.is_gguf:
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(_hf_config_dict(mc), f, indent=1)
    else:
        for name in _HF_FILES:
            if os.path.isfile(os.path.join(source.path, name)):
                shutil.copy(os.path.join(source.path, name), out_dir)
    try:
        tokenizer = Tokenizer.from_source(source.path, source.gguf_file)
    except (ValueError, KeyError) as e:  # e.g. a GGUF without a usable tokenizer
        logger.warning("no tokenizer saved with the checkpoint (load it with tokenizer=): %s", e)
        return
    tokenizer.hf_tokenizer.save_pretrained(out_dir)


def load_quantized(path: str | os.PathLike) -> tuple[ModelConfig, "nnx.Module"]:
    """(ModelConfig, model) from a directory written by save_quantized, weights as stored."""
    import orbax.checkpoint as ocp  # heavy: only when a checkpoint is loaded

    path = os.path.abspath(os.fspath(path))
    with open(os.path.join(path, MANIFEST)) as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ValueError(f"{path!r} is not a {FORMAT} v{VERSION} checkpoint")
    config = ModelConfig.from_dict(manifest["model_config"])
    dtype = jnp.dtype(manifest["dtype"])

    def build():
        model = LlamaForCausalLM(config, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))
        return _apply_specs(model, manifest["modules"])

    graphdef, abstract_state = nnx.split(nnx.eval_shape(build))
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                          nnx.to_pure_dict(abstract_state))
    restored = ocp.StandardCheckpointer().restore(os.path.join(path, PARAMS_DIR), target)
    nnx.replace_by_pure_dict(abstract_state, restored)
    return config, nnx.merge(graphdef, abstract_state)
