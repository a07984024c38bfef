import pytest

from jaxinfer.sched.buckets import StepBuckets, all_buckets, next_power_of_2, width_bucket
from jaxinfer.sched.step_input import warmup_step_inputs
from tests.sched.fake_runner import make_config


def test_bucket_functions():
    assert [next_power_of_2(n) for n in (0, 1, 2, 3, 8, 9)] == [1, 1, 2, 4, 8, 16]
    b = StepBuckets.from_config(make_config(page_size=16, max_num_seqs=64, max_num_batched_tokens=512), 8192)
    assert b.token_buckets == (8, 16, 32, 64, 128, 256, 512)
    assert b.seq_buckets == (1, 2, 4, 8, 16, 32, 64)
    assert b.page_buckets == tuple(2**i for i in range(10)) and b.page_buckets[-1] == 8192 // 16
    assert b.pick(1, 1, 1) == (8, 1, 1)
    assert b.pick(9, 3, 17) == (16, 4, 32)
    with pytest.raises(ValueError, match="num_tokens=513"):
        b.pick(513, 1, 1)
    shapes = b.all_shapes()
    assert len(shapes) == len(set(shapes)) and all(s <= t for t, s, _ in shapes)
    assert all_buckets(make_config(page_size=16, max_num_seqs=64, max_num_batched_tokens=512), 8192) == shapes
    # every pick of a feasible step is among the warm-up shapes
    for t in range(1, 513, 37):
        for s in range(1, min(t, 64) + 1, 5):
            assert b.pick(t, s, 1 + t % 512) in set(shapes)
    warm = list(warmup_step_inputs(make_config(page_size=4, max_num_seqs=2, max_num_batched_tokens=8), 16))
    assert [w.shape for w in warm] == [(8, s, p) for s in (1, 2) for p in (1, 2, 4)]


def test_coarse_buckets_cover_every_step_with_few_shapes():
    cfg = make_config(page_size=16, max_num_seqs=64, max_num_batched_tokens=512)
    b = StepBuckets.coarse(cfg, 8192)
    shapes = b.all_shapes()
    assert len(shapes) == len(set(shapes)) <= 2 * len(b.token_buckets)
    assert {p for _, _, p in shapes} == {512}
    for t in range(1, 513, 7):
        for s in range(1, min(t, 64) + 1, 3):
            T, S, P = b.pick(t, s, 1 + t % 512)
            assert (T, S, P) in set(shapes) and T >= t and S >= s
    assert b.pick(3, 1, 1) == (4, 1, 512) and b.pick(3, 3, 1) == (4, 4, 512)
    assert b.pick(100, 20, 3) == (128, 64, 512)


def test_intermediate_buckets_for_decode_sizes_between_powers_of_two():
    cfg = make_config(page_size=16, max_num_seqs=64, max_num_batched_tokens=512)
    b = StepBuckets.coarse(cfg, 8192, intermediate=True)
    assert b.token_buckets == (1, 2, 4, 8, 16, 24, 32, 48, 64, 128, 256, 512)
    assert b.seq_buckets == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    shapes = set(b.all_shapes())
    assert {(24, 24, 512), (48, 48, 512), (24, 1, 512), (48, 1, 512)} <= shapes
    assert b.pick(40, 40, 3) == (48, 48, 512) and b.pick(17, 17, 3) == (24, 24, 512)
    assert b.pick(49, 49, 3) == (64, 64, 512) and b.pick(100, 20, 3) == (128, 64, 512)
    for t in range(1, 513, 5):
        for s in range(1, min(t, 64) + 1, 3):
            T, S, P = b.pick(t, s, 1)
            assert (T, S, P) in shapes and T >= t and S >= s
    small = make_config(page_size=16, max_num_seqs=16, max_num_batched_tokens=512)
    assert 24 not in StepBuckets.coarse(small, 8192, intermediate=True).token_buckets


def test_width_bucket():
    assert [width_bucket(n) for n in (0, 1, 8, 9, 17)] == [8, 8, 8, 16, 32]
