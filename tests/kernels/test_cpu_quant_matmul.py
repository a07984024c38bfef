"""The CPU quantized matmul kernel (C++, XLA FFI) against the plain-jnp reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels.quant_matmul import (available, dequantize, padded_stride, quant_matmul,
                                      quant_matmul_q8_reference, quantize_activations_reference)
from jaxinfer import quant
from pallas_kernels.quant_matmul import quant_matmul_reference

TOL = 2e-6  # relative: f32 accumulation in another order than the reference's


@pytest.fixture(scope="module", autouse=True)
def kernel_built():
    assert available(), "the CPU kernel did not build (is a C++ compiler installed?)"


def _weight(k, n, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((k, n)) * 0.05, jnp.float32)


def _check(qw, m, dtype=jnp.float32):
    x = jnp.asarray(np.random.default_rng(m).standard_normal((m, qw.shape[0])), dtype)
    y = jax.jit(lambda x, v, s, mi: quant_matmul(x, v, s, mi, bits=qw.bits,
                                                 group_size=qw.group_size))(
        x, qw.values, qw.scales, qw.mins)
    ref = quant_matmul_reference(x.astype(jnp.float32), qw.values, qw.scales, qw.mins,
                                 bits=qw.bits, group_size=qw.group_size)
    assert y.shape == (m, qw.shape[1]) and y.dtype == dtype
    err = float(jnp.abs(y.astype(jnp.float32) - ref).max() / jnp.abs(ref).max())
    return err


# AVX-512: 1 row codes widened by shifts, 2 per row pair, 3 and more panels in tiles of 6 rows
# and a tail (70 = 11 x 6 + 4); AVX2: 1 to 4 rows codes widened from memory in registers (3 and
# 4 rows of int4 codes one half of the nibbles at a time), more panels in tiles of 6 rows and a
# tail (7 = 6 + 1, 8 = 6 + 2, 9 = 6 + 3, 13 = 2 x 6 + 1). N = 320: a 64-column block beside the
# 256-column work item.
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 8, 9, 13, 70])
@pytest.mark.parametrize("kind", ["int8 g32", "int8 channel", "int4 asym g32", "int4 sym g32",
                                  "int4 asym g64 f32 scales"])
def test_matches_reference(kind, m):
    w = _weight(576, 320)
    qw = {"int8 g32": lambda: quant.quantize_int8(w, 32),
          "int8 channel": lambda: quant.quantize_int8(w),
          "int4 asym g32": lambda: quant.quantize_int4(w, 32, symmetric=False),
          "int4 sym g32": lambda: quant.quantize_int4(w, 32, symmetric=True),
          "int4 asym g64 f32 scales": lambda: quant.quantize_int4(  # K/2 = 320: 5 groups of 64
              _weight(640, 320), 64, symmetric=False, scale_dtype=jnp.float32)}[kind]()
    assert _check(qw, m) < TOL


# One row of x (with AVX2 and no AVX-512: up to four) is cut into blocks of up to 4096 columns
# and, where that gives too few work items, ranges of code rows (at least 64 rows each, cut
# inside a group where it falls there) whose partial rows are added at the end. K = 128: one range of rows, the 3 chunks of 64
# columns in two blocks; K = 1536: two ranges of rows, 9 chunks as 4 + 4 + 1; K = 2112, N = 64:
# ranges cut mid-group, one chunk; N = 32832: nine blocks and one range of rows (a wide LM
# head's split); N = 96 (not a multiple of 64) takes the row-pair path.
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("k,n", [(128, 192), (1536, 576), (2112, 64), (64, 32832), (576, 96)])
@pytest.mark.parametrize("kind", ["int4 asym", "int4 sym", "int8 g32", "int8 channel"])
def test_few_row_work_splits(k, n, kind, m):
    w = _weight(k, n, seed=k + n)
    qw = {"int4 asym": lambda: quant.quantize_int4(w, 32, symmetric=False),
          "int4 sym": lambda: quant.quantize_int4(w, 32, symmetric=True),
          "int8 g32": lambda: quant.quantize_int8(w, 32),
          "int8 channel": lambda: quant.quantize_int8(w)}[kind]()
    assert _check(qw, m) < TOL


def test_gguf_blocks_as_stored_and_bf16_activations():
    """A Q4_1 tensor imported as stored (f16 scales and minimums), and bf16 activations in."""
    k, n = 64, 96
    rng = np.random.default_rng(3)
    blocks = rng.integers(0, 256, (n, k // 32 * 20), dtype=np.uint8)
    blocks[:, 0::20], blocks[:, 1::20] = 0x00, 0x24  # f16 scales ~0.016
    blocks[:, 2::20], blocks[:, 3::20] = 0x00, 0xa4  # f16 minimums ~-0.016
    qw = quant.from_gguf(blocks, "Q4_1", (n, k))
    assert _check(qw, 2) < TOL
    assert _check(quant.quantize_int8(_weight(64, 96), 32), 2, jnp.bfloat16) < 1e-2


def test_layouts_it_does_not_take_raise_not_implemented():
    w = _weight(576, 100)
    q8 = quant.quantize_int8(w, 32)
    x = jnp.ones((1, 576), jnp.float32)
    with pytest.raises(NotImplementedError, match="multiple of 32"):
        quant_matmul(x, q8.values, q8.scales, bits=8, group_size=32)
    q4 = quant.quantize_int4(_weight(576, 64), 128, symmetric=False)  # K/2 = 288: not 128s
    with pytest.raises(NotImplementedError, match="group size"):
        quant_matmul(x, q4.values, q4.scales, q4.mins, bits=4, group_size=128)


def test_validation():
    q8 = quant.quantize_int8(_weight(64, 32), 32)
    with pytest.raises(ValueError, match="bits"):
        quant_matmul(jnp.ones((1, 64)), q8.values, q8.scales, bits=2, group_size=32)
    with pytest.raises(ValueError, match="does not fit"):
        quant_matmul(jnp.ones((1, 32)), q8.values, q8.scales, bits=8, group_size=32)
    with pytest.raises(ValueError, match="scales"):
        quant_matmul(jnp.ones((1, 64)), q8.values, q8.scales[:1], bits=8, group_size=32)


@pytest.mark.parametrize("kind", ["int8 g32", "int8 channel", "int4 asym g32", "int4 sym g32"])
def test_dequantize_is_exact(kind):
    """The kernel's f32 weight equals quant.dequantize bit for bit (the many-row path)."""
    w = _weight(576, 320, seed=5)
    qw = {"int8 g32": lambda: quant.quantize_int8(w, 32), "int8 channel": lambda: quant.quantize_int8(w),
          "int4 asym g32": lambda: quant.quantize_int4(w, 32, symmetric=False),
          "int4 sym g32": lambda: quant.quantize_int4(w, 32, symmetric=True)}[kind]()
    out = dequantize(qw.values, qw.scales, qw.mins, bits=qw.bits, group_size=qw.group_size, k=576)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(quant.dequantize(qw)))


def test_independent_calls_in_one_step_do_not_wait_on_each_other():
    """XLA may run two independent custom calls at the same time, one per pool thread; each
    spreads its work over the pool and must not wait for a helper queued behind the other."""
    qws = [quant.quantize_int8(_weight(576, 4096, seed=s), 32) for s in range(4)]
    x = jnp.ones((2, 576), jnp.float32)

    @jax.jit
    def four(x, a, b, c, d):
        return [quant_matmul(x, q.values, q.scales, bits=8, group_size=32) for q in (a, b, c, d)]

    for _ in range(20):
        outs = jax.block_until_ready(four(x, *qws))
    for out, qw in zip(outs, qws):
        ref = quant_matmul_reference(x, qw.values, qw.scales, bits=8, group_size=32)
        assert float(jnp.abs(out - ref).max() / jnp.abs(ref).max()) < TOL


def _kinds(k=576, n=320, seed=0):
    w = _weight(k, n, seed)
    return {"int8 g32": lambda: quant.quantize_int8(w, 32),
            "int8 channel": lambda: quant.quantize_int8(w),  # one group of 576: parts of 32
            "int4 asym g32": lambda: quant.quantize_int4(w, 32, symmetric=False),
            "int4 sym g32": lambda: quant.quantize_int4(w, 32, symmetric=True),
            "int4 asym g64 f32 scales": lambda: quant.quantize_int4(
                _weight(640, n, seed), 64, symmetric=False, scale_dtype=jnp.float32),
            "int4 asym g128": lambda: quant.quantize_int4(_weight(1024, n, seed), 128,
                                                          symmetric=False),
            # groups of 16: parts shorter than the kernel's 32 rows (its loop of variable length)
            "int8 g16": lambda: quant.quantize_int8(w, 16)}


def _q8(qw, x):
    return jax.jit(lambda x, v, s, mi: quant_matmul(
        x, v, s, mi, bits=qw.bits, group_size=qw.group_size, int8_activations=True))(
        x, qw.values, qw.scales, qw.mins)


# N = 320: 5 blocks of 64 columns, in work items of several blocks (on 2 threads 3 and 2); 5 rows:
# vpdpbusd tiles of 3 and 2;
# 70 rows: AMX tiles of 16 and a padded one of 6 (where the CPU has AMX; else tiles of 3 and 1)
@pytest.mark.parametrize("m", [1, 5, 70])
@pytest.mark.parametrize("kind", list(_kinds()))
def test_int8_activations_match_their_reference(kind, m):
    qw = _kinds()[kind]()
    x = jnp.asarray(np.random.default_rng(m).standard_normal((m, qw.shape[0])), jnp.float32)
    y = _q8(qw, x)
    ref = quant_matmul_q8_reference(x, qw.values, qw.scales, qw.mins, bits=qw.bits,
                                    group_size=qw.group_size)
    assert y.shape == (m, qw.shape[1])
    assert float(jnp.abs(y - ref).max() / jnp.abs(ref).max()) < TOL
    # and it is x @ W up to x's rounding to int8 (~1% of the output's scale), not something else
    full = quant_matmul_reference(x, qw.values, qw.scales, qw.mins, bits=qw.bits,
                                  group_size=qw.group_size)
    assert 1e-4 < float(jnp.abs(y - full).max() / jnp.abs(full).max()) < 0.05


def test_int8_activations_round_x_per_group_as_the_reference_does():
    x = jnp.asarray([[0.5, -1.27, 0.01, 0.0] * 8 + [0.0] * 32], jnp.float32)  # 2 groups of 32
    q, d, sums = quantize_activations_reference(x, 32)
    assert q[0, :4].tolist() == [50, -127, 1, 0] and q[0, 32:].tolist() == [0] * 32
    np.testing.assert_allclose(np.asarray(d), [[1.27 / 127, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(sums), [[(0.5 - 1.27 + 0.01) * 8, 0.0]], rtol=1e-5)


def test_int8_activations_give_a_row_the_same_result_at_any_row_count():
    """Batch invariance: a row's result does not depend on the rows beside it (vpdpbusd tiles of
    3, 2, 1 rows; from 32 rows AMX tiles of 16 where the CPU has them, whose rows must equal the
    vpdpbusd ones bit for bit)."""
    for kind in ("int4 asym g32", "int8 g32", "int8 channel"):
        qw = _kinds()[kind]()
        x = jnp.asarray(np.random.default_rng(9).standard_normal((40, 576)), jnp.float32)
        whole = np.asarray(_q8(qw, x))
        for i in range(0, 40, 5):
            np.testing.assert_array_equal(np.asarray(_q8(qw, x[i:i + 1]))[0], whole[i])
        np.testing.assert_array_equal(np.asarray(_q8(qw, x[2:4])), whole[2:4])
        np.testing.assert_array_equal(np.asarray(_q8(qw, x[2:9])), whole[2:9])


def test_int8_activations_layouts_they_do_not_take_raise_not_implemented():
    x = jnp.ones((1, 576), jnp.float32)
    q8 = quant.quantize_int8(_weight(576, 96), 32)  # N = 96: a multiple of 32, not of 64
    with pytest.raises(NotImplementedError, match="multiple of 64"):
        quant_matmul(x, q8.values, q8.scales, bits=8, group_size=32, int8_activations=True)


@pytest.mark.parametrize("int8_activations", [False, True])
@pytest.mark.parametrize("kind", ["int4 asym g32", "int8 g32", "int4 asym g128"])
def test_only_the_real_rows_are_multiplied(kind, int8_activations):
    """`num_rows` (a traced scalar, as a step's real token count is): rows below it are the
    product of those rows alone (bit for bit, with int8 activations as at any row count; float
    x as the kernel gives them at that row count), the rest zero, even where x holds NaN there;
    out of range it is clamped to [0, M]."""
    qw = _kinds()[kind]()
    m = 16
    x = np.random.default_rng(3).standard_normal((m, qw.shape[0])).astype(np.float32)
    call = jax.jit(lambda x, n: quant_matmul(x, qw.values, qw.scales, qw.mins, bits=qw.bits,
                                             group_size=qw.group_size,
                                             int8_activations=int8_activations, num_rows=n))
    for n in (0, 1, 2, 5, 9, 16):
        padded = x.copy()
        padded[n:] = np.nan  # padding rows are never read
        got = np.asarray(call(jnp.asarray(padded), jnp.int32(n)))
        assert got.shape == (m, qw.shape[1])
        np.testing.assert_array_equal(got[n:], 0.0)
        if n:
            alone = np.asarray(call(jnp.asarray(x[:n]), jnp.int32(n)))
            np.testing.assert_array_equal(got[:n], alone)
            ref = (quant_matmul_q8_reference if int8_activations else quant_matmul_reference)(
                jnp.asarray(x[:n]), qw.values, qw.scales, qw.mins, bits=qw.bits,
                group_size=qw.group_size)
            assert float(jnp.abs(got[:n] - ref).max() / jnp.abs(ref).max()) < TOL
    whole = np.asarray(call(jnp.asarray(x), jnp.int32(m)))
    np.testing.assert_array_equal(np.asarray(call(jnp.asarray(x), jnp.int32(99))), whole)
    np.testing.assert_array_equal(np.asarray(call(jnp.asarray(x), jnp.int32(-3))), 0.0)
    if int8_activations:  # a row's result does not depend on the row count
        np.testing.assert_array_equal(
            np.asarray(call(jnp.asarray(x), jnp.int32(5)))[:5], whole[:5])


def test_padded_stride_gives_rows_an_odd_number_of_cache_lines():
    assert [padded_stride(n) for n in (960, 576, 3072, 4096, 49152, 14336, 96, 100)] == \
        [960, 576, 3136, 4160, 49216, 14400, 96, 100]


def _with_garbage_padding(qw, stride):
    """qw's arrays with rows `stride` long, the columns past N filled with what a kernel must
    never read: codes of every value and NaN scales and minimums."""
    n = qw.shape[1]
    rng = np.random.default_rng(11)

    def pad(a, fill):
        extra = fill(a.shape[:-1] + (stride - n,)).astype(a.dtype)
        return jnp.asarray(np.concatenate([np.asarray(a), extra], axis=-1))

    codes = lambda shape: rng.integers(-128 if qw.bits == 8 else 0, 128 if qw.bits == 8 else 256,
                                       shape)
    nan = lambda shape: np.full(shape, np.nan)
    return (pad(qw.values, codes), pad(qw.scales, nan),
            None if qw.mins is None else pad(qw.mins, nan))


# N = 128 (two 64-column blocks, an even number: padded to 192) and 320 (+64 by hand); 1 row: the
# one-row split; 2: row pairs; 9 and 70: panels, vpdpbusd tiles (and AMX from 32 rows)
@pytest.mark.parametrize("int8_activations", [False, True])
@pytest.mark.parametrize("kind", ["int8 g32", "int4 asym g32", "int4 sym g32", "int8 channel"])
def test_a_padded_stride_gives_the_same_products_bit_for_bit(kind, int8_activations):
    """Rows longer than N (a padded stride): the same y and dequantized W, bit for bit, with the
    padding's codes and NaN parameters never read."""
    for n, stride in ((128, padded_stride(128)), (320, 384)):
        qw = _kinds(n=n)[kind]()
        values, scales, mins = _with_garbage_padding(qw, stride)
        assert values.shape[1] == scales.shape[1] == stride > n
        for m in (1, 2, 9, 70):
            x = jnp.asarray(np.random.default_rng(m).standard_normal((m, qw.shape[0])), jnp.float32)
            plain = quant_matmul(x, qw.values, qw.scales, qw.mins, bits=qw.bits,
                                 group_size=qw.group_size, int8_activations=int8_activations)
            padded = quant_matmul(x, values, scales, mins, bits=qw.bits, group_size=qw.group_size,
                                  int8_activations=int8_activations, columns=n)
            assert padded.shape == (m, n)
            np.testing.assert_array_equal(np.asarray(padded), np.asarray(plain))
        k = qw.shape[0]
        np.testing.assert_array_equal(
            np.asarray(dequantize(values, scales, mins, bits=qw.bits, group_size=qw.group_size,
                                  k=k, columns=n)),
            np.asarray(dequantize(qw.values, qw.scales, qw.mins, bits=qw.bits,
                                  group_size=qw.group_size, k=k)))


def test_columns_beyond_the_rows_are_refused():
    qw = quant.quantize_int8(_weight(64, 128), 32)
    with pytest.raises(ValueError, match="columns"):
        quant_matmul(jnp.ones((1, 64)), qw.values, qw.scales, bits=8, group_size=32, columns=192)


def test_the_rows_above_which_a_dense_matmul_takes_over_follow_the_cpu(monkeypatch):
    from cpu_kernels import build
    from cpu_kernels import quant_matmul as cpu_quant

    monkeypatch.setattr(build, "cpu_flags", lambda: "fpu fma avx2 avx512f avx512bw")
    assert cpu_quant.dense_faster_above_rows() is None  # the AVX-512 panels win at every size
    monkeypatch.setattr(build, "cpu_flags", lambda: "fpu fma avx2")
    assert cpu_quant.dense_faster_above_rows() == 96  # the AVX2 panels, to ~128 rows
    monkeypatch.setattr(build, "cpu_flags", lambda: "fpu sse4_2")
    assert cpu_quant.dense_faster_above_rows() == 16  # plain loops


def test_without_a_float_copy_the_kernel_takes_every_row_count_it_beats_dense_at(monkeypatch):
    """No float copy kept (quantization other than auto): rows up to the kernel's crossover with
    a dense matmul read the codes; beyond it the weight is dequantized for XLA's matmul."""
    from cpu_kernels import quant_matmul as cpu_quant
    from jaxinfer import ops

    qw = quant.quantize_int4(_weight(128, 64), 32, symmetric=False)
    dequantized = []
    real_dequantize = cpu_quant.dequantize
    monkeypatch.setattr(cpu_quant, "dequantize",
                        lambda *a, **kw: dequantized.append(1) or real_dequantize(*a, **kw))
    monkeypatch.setattr(cpu_quant, "dense_faster_above_rows", lambda: 96)
    for rows, expect_dequantized in ((80, 0), (97, 1)):
        dequantized.clear()
        x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, 128)), jnp.float32)
        y = ops.quantized_matmul(x, qw, backend="cpu")
        ref = quant_matmul_reference(x, qw.values, qw.scales, qw.mins, bits=4, group_size=32)
        assert float(jnp.abs(y - ref).max() / jnp.abs(ref).max()) < TOL
        assert len(dequantized) == expect_dequantized
