"""The weights moved onto huge pages: the same values, zero-copy views of one mapping that Linux
backs with 2 MiB pages, and every array left where it was when that cannot be done."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.runtime import huge_pages

needs_thp = pytest.mark.skipif(not huge_pages.transparent_huge_pages(),
                               reason="this kernel gives no transparent huge pages on request")


def _tree():
    rng = np.random.default_rng(0)
    return {
        "codes": jnp.asarray(rng.integers(0, 256, (1536, 2048), dtype=np.uint8)),  # 3 MiB
        "scales": jnp.asarray(rng.random((96, 2048)).astype(np.float16)),
        "layers": [{"w": jnp.asarray(rng.standard_normal((576, 960)).astype(np.float32)),
                    "b": jnp.asarray(rng.standard_normal((3,)).astype(np.float32))}
                   for _ in range(2)],
        "bf16": jnp.asarray(rng.standard_normal((64, 64)), dtype=jnp.bfloat16),
        "empty": jnp.zeros((0, 8), jnp.float32),
        "step": 7,  # not an array: passed through
    }


def _mapping(address: int) -> tuple[int, int, int]:
    """(start, end, AnonHugePages in kB) of the mapping of this process that holds `address`."""
    found = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                found = (lo, hi) if lo <= address < hi else None
            elif found and line.startswith("AnonHugePages:"):
                return (*found, int(line.split()[1]))
    raise AssertionError(f"no mapping holds {address:#x}")


@needs_thp
def test_rehome_keeps_values_and_puts_them_on_huge_pages():
    tree = _tree()
    moved = huge_pages.rehome(tree)
    assert jax.tree.structure(moved) == jax.tree.structure(tree)
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(moved)):
        if isinstance(a, jax.Array):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        else:
            assert a == b
    start, end, huge_kb = _mapping(moved["codes"].unsafe_buffer_pointer())
    assert huge_kb >= 2048  # at least one 2 MiB page under the 3 MiB of codes
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(tree), jax.tree.leaves(moved)):
        if isinstance(a, jax.Array) and a.size and a.dtype != jnp.bfloat16:
            p = b.unsafe_buffer_pointer()
            assert p != a.unsafe_buffer_pointer(), f"{path} was not moved"
            assert start <= p and p + b.nbytes <= end, f"{path} is not in the one mapping"
            assert p % huge_pages.ALIGN == 0
    # the moved arrays compute as the originals do
    f = jax.jit(lambda t: t["layers"][0]["w"].sum() + t["codes"][:5].astype(jnp.float32).sum())
    assert float(f(moved)) == float(f(tree))


def test_rehome_leaves_everything_when_huge_pages_are_off(monkeypatch):
    monkeypatch.setattr(huge_pages, "transparent_huge_pages", lambda: False)
    tree = _tree()
    assert huge_pages.rehome(tree) is tree


def test_rehome_without_arrays_is_the_tree():
    tree = {"a": 1, "b": [2.0, "x"]}
    assert huge_pages.rehome(tree) is tree


@needs_thp
def test_a_dtype_dlpack_cannot_carry_stays_where_it_was():
    # numpy exports no bfloat16 through DLPack: that array stays, the float32 one moves
    tree = {"bf16": jnp.ones((1024, 1024), jnp.bfloat16), "f32": jnp.ones((1024, 1024))}
    moved = huge_pages.rehome(tree)
    assert moved["bf16"] is tree["bf16"]
    assert moved["f32"].unsafe_buffer_pointer() != tree["f32"].unsafe_buffer_pointer()
    np.testing.assert_array_equal(np.asarray(moved["f32"]), np.asarray(tree["f32"]))
