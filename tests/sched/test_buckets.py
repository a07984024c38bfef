import numpy as np
import pytest

from jaxinfer.sched.buckets import StepBuckets, all_buckets, next_power_of_2, width_bucket
from jaxinfer.sched.step_input import calibration_step_inputs, warmup_step_inputs
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


@pytest.mark.parametrize("max_num_seqs", [1, 8])
def test_calibration_steps_are_warmed_up_layouts_of_real_tokens(max_num_seqs):
    """Speculation's calibration steps: t real tokens (1 .. K + 1 as one verifying sequence,
    then each larger bucket full, a row a sequence), each in a layout warm-up compiles (the same
    shape, rows and optional arrays), on the null page only."""
    cfg = make_config(page_size=4, max_num_seqs=max_num_seqs, max_num_batched_tokens=32,
                      speculative_method="ngram", num_speculative_tokens=4)

    def layout(si):
        return si.shape, si.seeds.shape[0], tuple(si.array_fields())

    warm = {layout(si) for si in warmup_step_inputs(cfg, 64)}
    steps = list(calibration_step_inputs(cfg, 64))
    assert [t for t, _ in steps] == [1, 2, 3, 4, 5, 8, 16, 32]
    for t, si in steps:
        assert layout(si) in warm
        n = int(si.num_seqs[0])
        q_lens = np.diff(si.cu_q_lens)
        assert si.cu_q_lens[-1] == t and (q_lens[:n] >= 1).all() and (q_lens[n:] == 0).all()
        assert (si.kv_lens[:n] == q_lens[:n]).all() and (si.page_indices == 0).all()
        assert (si.slot_mapping < cfg.page_size).all()  # the null page's slots
        if t <= 5:  # one sequence verifying t - 1 drafts: every token a sampled row
            assert n == 1 and (si.spec_row_ids is not None) == (t > 1)
            assert si.logits_indices[:t].tolist() == list(range(t))
        else:  # a batch (or a prefill with one sequence): a row a sequence, its last token
            assert n == min(t, max_num_seqs) and si.spec_row_ids is None
            assert si.logits_indices[:n].tolist() == (si.cu_q_lens[1:n + 1] - 1).tolist()
