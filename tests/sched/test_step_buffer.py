import numpy as np
import pytest

from jaxinfer.sched.step_buffer import PackedField, pack, unpack


def test_pack_unpack_round_trip_keeps_bits_and_order():
    arrays = [("a", np.arange(6, dtype=np.int32).reshape(2, 3)),
              ("b", np.array([1.5, -np.inf, np.nan], np.float32)),
              ("c", np.array([2**32 - 1, 0], np.uint32))]
    buf, layout = pack(arrays)
    assert buf.dtype == np.int32 and buf.shape == (11,)
    assert layout == (PackedField("a", 0, (2, 3), "int32"), PackedField("b", 6, (3,), "float32"),
                      PackedField("c", 9, (2,), "uint32"))
    out = unpack(buf, layout, lambda x, d: x.view(d))
    assert list(out) == ["a", "b", "c"]
    for name, ref in arrays:
        assert out[name].dtype == ref.dtype and out[name].tobytes() == ref.tobytes(), name


def test_pack_refuses_other_dtypes():
    with pytest.raises(ValueError, match="x: a.dtype=dtype\\('int64'\\)"):
        pack([("x", np.zeros(2, np.int64))])
