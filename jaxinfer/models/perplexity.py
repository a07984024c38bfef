"""Perplexity of a model on a text: the body of `jaxinfer eval-ppl` and of benchmarks/quant.py.

The text is fed as one sequence through the paged KV cache in prefill chunks (every token sees
its whole left context, as in the engine), and the negative log-likelihood of each next token is
summed on the device.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.config import EngineConfig
from jaxinfer.models import quant_checkpoint
from jaxinfer.models.loader import load_model, model_source
from jaxinfer.models.sequence_pass import chunks, sequence_cache
from jaxinfer.tokenizer import Tokenizer


def perplexity(model, token_ids, *, chunk: int = 512, page_size: int = 16,
               kv_cache_dtype=None) -> float:
    """exp(mean NLL of token_ids[1:] given the tokens before each), one sequence.
    kv_cache_dtype: None (the model's dtype) or e.g. "int8" (quantized KV pages)."""
    token_ids = np.asarray(token_ids, np.int32)
    n = len(token_ids)
    if n < 2:
        raise ValueError(f"perplexity needs at least 2 tokens, got {n}")
    if n > model.config.max_position_embeddings:
        raise ValueError(f"the text has {n} tokens, more than the model's context "
                         f"({model.config.max_position_embeddings})")
    graphdef, state = nnx.split(model)
    cache = sequence_cache(model, n, page_size, kv_cache_dtype)

    @jax.jit
    def chunk_nll(state, cache, ids, pos, md, targets, valid):
        m = nnx.merge(graphdef, state)
        hidden, cache = m(ids, pos, cache, md, attention_backend="xla")
        logp = jax.nn.log_softmax(m.compute_logits(hidden), axis=-1)  # f32[T, V]
        picked = jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]
        return -jnp.sum(jnp.where(valid, picked, 0.0)), cache

    total = 0.0
    for c in chunks(token_ids[:-1], chunk, page_size):  # tokens 0..n-2 predict 1..n-1
        targets = np.zeros(chunk, np.int32)
        targets[:c.num_tokens] = token_ids[c.start + 1:c.start + 1 + c.num_tokens]
        nll, cache = chunk_nll(state, cache, c.input_ids, c.positions, c.md,
                               jnp.asarray(targets), c.valid)
        total += float(nll)
    return math.exp(total / (n - 1))


def eval_ppl(model: str, text_file: str | os.PathLike, engine_config=None, *,
             chunk: int = 512) -> tuple[float, int]:
    """`jaxinfer eval-ppl MODEL --text FILE [--quantization ...]` -> (perplexity, num_tokens).

    MODEL may also be a pre-quantized checkpoint directory (models/quant_checkpoint.py)."""
    with open(text_file) as f:
        text = f.read()
    if quant_checkpoint.is_quantized_checkpoint(model):
        _, module = quant_checkpoint.load_quantized(model)
        tokenizer = Tokenizer.from_source(model)
    else:
        _, module = load_model(model, engine_config or EngineConfig())
        source = model_source(model)
        tokenizer = Tokenizer.from_source(source.path, source.gguf_file)
    token_ids = tokenizer.encode(text)
    kv_cache_dtype = engine_config.kv_cache_dtype if engine_config is not None else None
    return perplexity(module, token_ids, chunk=chunk, kv_cache_dtype=kv_cache_dtype), len(token_ids)
