"""Calibration passes: statistics of a model's activations over calibration tokens (for GPTQ)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.models.sequence_pass import chunks, sequence_cache


def calibration_tokens(model_config, num_tokens: int, seed: int = 0) -> np.ndarray:
    """i32[num_seqs, seq_len]: num_tokens uniformly random token ids (rounded up to whole
    sequences), in sequences as long as the model's context allows. Random ids need no tokenizer
    or data set; for the LM head's GPTQ they give almost what model-generated text gives
    (docs/quantization.md)."""
    seq_len = max(1, min(int(num_tokens), model_config.max_position_embeddings))
    num_seqs = -(-int(num_tokens) // seq_len)
    rng = np.random.default_rng(seed)
    return rng.integers(0, model_config.vocab_size, (num_seqs, seq_len)).astype(np.int32)


def final_hidden_hessian(model, token_ids, *, chunk: int = 512, page_size: int = 16) -> np.ndarray:
    """f64[hidden, hidden]: E[h h^T] over the final-normed hidden states h (the LM head's
    inputs) of token_ids (i32[n]: one sequence; i32[num_seqs, n]: each row one sequence), run
    through the model in prefill chunks over a paged KV cache (XLA attention)."""
    token_ids = np.asarray(token_ids, np.int32)
    if token_ids.ndim == 1:
        token_ids = token_ids[None]
    num_seqs, n = token_ids.shape
    if n < 1 or n > model.config.max_position_embeddings:
        raise ValueError(f"{token_ids.shape=}: sequences must hold 1.."
                         f"{model.config.max_position_embeddings} tokens")
    chunk = min(chunk, -(-n // page_size) * page_size)
    graphdef, state = nnx.split(model)
    cache = sequence_cache(model, n, page_size)

    @jax.jit
    def chunk_hessian(state, cache, ids, pos, md, valid):
        hidden, cache = nnx.merge(graphdef, state)(ids, pos, cache, md, attention_backend="xla")
        h = jnp.where(valid[:, None], hidden.astype(jnp.float32), 0.0)  # f32[chunk, hidden]
        return jnp.dot(h.T, h, precision=jax.lax.Precision.HIGHEST), cache

    total = 0.0
    for seq in token_ids:  # each sequence overwrites the pages of the one before
        for c in chunks(seq, chunk, page_size):
            part, cache = chunk_hessian(state, cache, c.input_ids, c.positions, c.md, c.valid)
            total = total + np.asarray(part, np.float64)
    return total / token_ids.size
