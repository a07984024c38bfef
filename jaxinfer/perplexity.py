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


def perplexity(model, token_ids, *, chunk: int = 512, page_size: int = 16,
               kv_cache_dtype=None) -> float:
    """exp(mean NLL of token_ids[1:] given the tokens before each), one sequence.
    kv_cache_dtype: None (the model's dtype) or e.g. "int8" (quantized KV pages)."""
    from jaxinfer.runtime.kv_cache import AttentionMetadata, allocate_kv_cache

    token_ids = np.asarray(token_ids, np.int32)
    n = len(token_ids)
    if n < 2:
        raise ValueError(f"perplexity needs at least 2 tokens, got {n}")
    if n > model.config.max_position_embeddings:
        raise ValueError(f"the text has {n} tokens, more than the model's context "
                         f"({model.config.max_position_embeddings})")
    graphdef, state = nnx.split(model)
    num_pages = -(-n // page_size) + 1
    pages = np.arange(1, num_pages, dtype=np.int32)  # page 0 is the null page
    cache = allocate_kv_cache(model.config, num_pages, page_size, kv_cache_dtype or model.dtype)

    @jax.jit
    def chunk_nll(state, cache, ids, pos, md, targets, valid):
        m = nnx.merge(graphdef, state)
        hidden, cache = m(ids, pos, cache, md, attention_backend="xla")
        logp = jax.nn.log_softmax(m.compute_logits(hidden), axis=-1)  # f32[T, V]
        picked = jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]
        return -jnp.sum(jnp.where(valid, picked, 0.0)), cache

    total, count = 0.0, 0
    for start in range(0, n - 1, chunk):
        stop = min(start + chunk, n - 1)  # tokens start..stop-1 predict start+1..stop
        q = stop - start
        ids = np.zeros(chunk, np.int32)
        ids[:q] = token_ids[start:stop]
        pos = np.zeros(chunk, np.int32)
        pos[:q] = np.arange(start, stop)
        slots = np.arange(chunk, dtype=np.int32) % page_size  # padding -> the null page
        slots[:q] = pages[pos[:q] // page_size] * page_size + pos[:q] % page_size
        targets = np.zeros(chunk, np.int32)
        targets[:q] = token_ids[start + 1:stop + 1]
        md = AttentionMetadata(
            slot_mapping=jnp.asarray(slots), cu_q_lens=jnp.asarray([0, q], jnp.int32),
            kv_lens=jnp.asarray([stop], jnp.int32), page_indices=jnp.asarray(pages[None, :]),
            num_seqs=jnp.asarray([1], jnp.int32))
        nll, cache = chunk_nll(state, cache, jnp.asarray(ids), jnp.asarray(pos), md,
                               jnp.asarray(targets), jnp.arange(chunk) < q)
        total += float(nll)
        count += q
    return math.exp(total / count)


def eval_ppl(model: str, text_file: str | os.PathLike, engine_config=None, *,
             chunk: int = 512) -> tuple[float, int]:
    """`jaxinfer eval-ppl MODEL --text FILE [--quantization ...]` -> (perplexity, num_tokens).

    MODEL may also be a pre-quantized checkpoint directory (jaxinfer.quant_checkpoint)."""
    from jaxinfer import quant_checkpoint
    from jaxinfer.config import EngineConfig
    from jaxinfer.models.loader import load_model, model_source
    from jaxinfer.tokenizer import Tokenizer

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
