"""Flax NNX models (Llama family) and their loaders. Imports lazily: `from jaxinfer.models import
load_model` pulls in JAX, `jaxinfer.models.gguf_file` does not."""

_EXPORTS = {
    "LlamaForCausalLM": "jaxinfer.models.llama",
    "load_model": "jaxinfer.models.loader",
    "load_model_config": "jaxinfer.models.loader",
    "model_source": "jaxinfer.models.loader",
    "resolve_model_path": "jaxinfer.models.loader",
    "ModelSource": "jaxinfer.models.loader",
    "init_dummy_model": "jaxinfer.models.loader",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(name)
