"""Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2) over the paged KV cache, in Flax NNX.

Decoder layers are created stacked (every param has a leading [num_layers] axis: loaders,
quantization and checkpoints see one array per weight) and run under `jax.lax.scan` with the
whole stacked KV cache in the carry; each layer writes its K/V at [layer, page, offset], which XLA
does in place when the cache is donated (docs/architecture.md). `unroll_layers()` gives each layer
params of its own for a forward that runs them in sequence (faster on the CPU).
Q/K/V are one fused projection (`qkv_proj`), gate/up another (`gate_up_proj`): fewer, larger
matmuls. Every projection is a `layers.Linear`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxinfer import ops
from jaxinfer.config import ModelConfig
from jaxinfer.models.layers import Embed, Linear, RMSNorm, apply_rope, rope_cos_sin, rope_inv_freq
from jaxinfer.models.tp_layout import split_gate_up, split_qkv
from jaxinfer.ops.kv_cache import AttentionMetadata, KVCache


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.sliding_window = config.sliding_window
        # (static) tensor-parallel shards of qkv_proj's column order (models/tp_layout.py)
        self.tp_shards = 1
        qkv_features = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.qkv_proj = Linear(config.hidden_size, qkv_features, use_bias=config.attention_bias,
                               dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.o_proj = Linear(config.num_heads * config.head_dim, config.hidden_size,
                             dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x, cos, sin, kv_cache: KVCache, layer, md: AttentionMetadata,
                 attention_backend: str, mesh: Mesh | None = None):
        # x: [T, hidden]; cos, sin: f32[T, D // 2]; layer: i32[]; mesh: tensor-parallel (ops)
        num_tokens = x.shape[0]
        real = md.num_real_tokens
        q_size = self.num_heads * self.head_dim
        with jax.named_scope("qkv_proj"):
            qkv = self.qkv_proj(x, real)  # [T, (Hq + 2 Hkv) D]
        with jax.named_scope("rope"):
            q, k, v = split_qkv(qkv, self.num_heads, self.num_kv_heads, self.head_dim,
                                self.tp_shards)  # [T, Hq, D], [T, Hkv, D], [T, Hkv, D]
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
        with jax.named_scope("kv_write"):
            kv_cache = ops.write_kv(kv_cache, layer, k, v, md.slot_mapping,
                                    backend=attention_backend, mesh=mesh)
        with jax.named_scope("attention"):
            out = ops.ragged_paged_attention(
                q, kv_cache.k, kv_cache.v, layer, md, sm_scale=self.head_dim ** -0.5,
                sliding_window=self.sliding_window, backend=attention_backend,
                k_scale=kv_cache.k_scale, v_scale=kv_cache.v_scale, mesh=mesh)  # [T, Hq, D]
        with jax.named_scope("o_proj"):
            return self.o_proj(out.reshape(num_tokens, q_size), real), kv_cache


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused into one [hidden, 2 I] projection."""

    def __init__(self, config: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.intermediate_size = config.intermediate_size
        self.tp_shards = 1  # (static) tensor-parallel shards of gate_up_proj's column order
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size,
                                   dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size,
                                dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x, num_rows: jax.Array | None = None):
        # x: [T, hidden]; num_rows: i32[], x's real rows (Linear)
        with jax.named_scope("gate_up_proj"):
            gate_up = self.gate_up_proj(x, num_rows)  # [T, 2 I]
        gate, up = split_gate_up(gate_up, self.intermediate_size, self.tp_shards)  # [T, I] each
        with jax.named_scope("down_proj"):
            return self.down_proj(jax.nn.silu(gate) * up, num_rows)


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        norm = dict(eps=config.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, **norm)
        self.self_attn = Attention(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, **norm)
        self.mlp = MLP(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x, cos, sin, kv_cache, layer, md, attention_backend, mesh=None):
        with jax.named_scope("norm"):
            h = self.input_layernorm(x)
        attn_out, kv_cache = self.self_attn(h, cos, sin, kv_cache, layer, md, attention_backend,
                                            mesh)
        x = x + attn_out
        with jax.named_scope("norm"):
            h = self.post_attention_layernorm(x)
        x = x + self.mlp(h, md.num_real_tokens)
        return x, kv_cache


class LlamaForCausalLM(nnx.Module):
    """model(input_ids, positions, kv_cache, md) -> (final-normed hidden [T, H], kv_cache)."""

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, param_dtype=jnp.float32,
                 rngs: nnx.Rngs):
        self.config = config
        self.dtype = dtype
        self.embed_tokens = Embed(config.vocab_size, config.hidden_size, dtype=dtype,
                                  param_dtype=param_dtype, rngs=rngs)

        @nnx.split_rngs(splits=config.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(rngs: nnx.Rngs) -> DecoderLayer:
            return DecoderLayer(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

        self.layers = make_layers(rngs)  # one DecoderLayer whose params lead with [num_layers]
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype,
                            param_dtype=param_dtype)
        self.lm_head = None if config.tie_word_embeddings else Linear(
            config.hidden_size, config.vocab_size, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    @property
    def layers_unrolled(self) -> bool:
        return isinstance(self.layers, nnx.List)

    def unroll_layers(self) -> "LlamaForCausalLM":
        """Gives every decoder layer params of its own (in place; returns the model): the forward
        then runs the layers one after the other instead of under `lax.scan`. On the CPU this
        is faster: a scan slices each layer's weights out of the stacked arrays, and XLA:CPU
        copies every slice before its matmul, i.e. the whole model once per step. The cost is
        compile time (one traced body per layer instead of one)."""
        if self.layers_unrolled:
            return self
        graphdef, state = nnx.split(self.layers)
        layers = []
        for i in range(self.config.num_layers):
            layers.append(nnx.merge(graphdef, jax.tree.map(lambda x: x[i], state)))
        del state  # the stacked arrays go when the last reference does
        self.layers = nnx.List(layers)
        return self

    def __call__(self, input_ids: jax.Array, positions: jax.Array, kv_cache: KVCache,
                 md: AttentionMetadata, attention_backend: str = "xla", mesh: Mesh | None = None):
        # input_ids, positions: i32[T] -> hidden [T, hidden_size], kv_cache (updated); mesh: the
        # tensor-parallel mesh the weights and cache are placed on, where the attention kernels
        # run per device (ops/sharded.py); None on one device
        cos, sin = rope_cos_sin(positions, rope_inv_freq(self.config))
        hidden = self.embed_tokens(input_ids)
        if self.layers_unrolled:
            for i, decoder_layer in enumerate(self.layers):
                hidden, kv_cache = decoder_layer(hidden, cos, sin, kv_cache, jnp.int32(i), md,
                                                 attention_backend, mesh)
            return self.norm(hidden), kv_cache
        layers_def, layers_state = nnx.split(self.layers)

        def one_layer(carry, layer_state):
            hidden, kv_cache, layer = carry
            decoder_layer = nnx.merge(layers_def, layer_state)
            hidden, kv_cache = decoder_layer(hidden, cos, sin, kv_cache, layer, md,
                                             attention_backend, mesh)
            return (hidden, kv_cache, layer + 1), None

        (hidden, kv_cache, _), _ = jax.lax.scan(
            one_layer, (hidden, kv_cache, jnp.zeros((), jnp.int32)), layers_state)
        return self.norm(hidden), kv_cache

    def compute_logits(self, hidden: jax.Array, num_rows: jax.Array | None = None) -> jax.Array:
        # hidden: [R, hidden_size] (rows of __call__'s output) -> f32[R, vocab_size]; num_rows:
        # i32[], rows beyond the first num_rows are padding (their logits are not read)
        with jax.named_scope("lm_head"):
            if self.lm_head is None:
                return self.embed_tokens.attend(hidden, num_rows)
            return self.lm_head(hidden, num_rows).astype(jnp.float32)
