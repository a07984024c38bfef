import numpy as np
import pytest

from jaxinfer.sched.buckets import StepBuckets
from jaxinfer.sched.output import RunnerOutput
from jaxinfer.sched.scheduler import Scheduler
from jaxinfer.sched.step_buffer import unpack
from jaxinfer.sched.step_input import empty_step_input, make_step_input
from tests.sched.fake_runner import EOS, make_config, make_request


def schedule_one_step(cfg, reqs, num_pages=32, max_model_len=64, warm=()):
    """Runs `warm` requests one step first (to fill the prefix cache), then schedules `reqs`."""
    sched = Scheduler(cfg, num_pages, max_model_len, (EOS,))
    for r in warm:
        sched.add_request(r)
    if warm:
        out = sched.schedule()
        sched.update(out, RunnerOutput(np.full(len(out.scheduled), 5, np.int32)))
    for r in reqs:
        sched.add_request(r)
    return sched, sched.schedule()


def test_padding_and_layout_of_a_mixed_step():
    cfg = make_config(page_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    a = make_request("a", range(10, 15), temperature=0.0)  # 5 tokens
    b = make_request("b", range(20, 26), temperature=0.7, top_k=-1, top_p=0.9, min_p=0.1, seed=2**33 + 5)
    sched, out = schedule_one_step(cfg, [a, b])
    si = make_step_input(out, cfg, 64)
    T, S, P = si.shape
    assert (T, S, P) == (16, 2, 2)
    assert si.num_rows == 2 and si.num_real_tokens == 11 and si.num_seqs.tolist() == [2]
    assert si.input_ids[:11].tolist() == list(range(10, 15)) + list(range(20, 26))
    assert si.input_ids[11:].tolist() == [0] * 5
    assert si.positions.tolist() == list(range(5)) + list(range(6)) + [0] * 5
    assert a.page_ids == [1, 2] and b.page_ids == [3, 4]
    assert si.slot_mapping[:11].tolist() == [4, 5, 6, 7, 8] + [12, 13, 14, 15, 16, 17]
    assert si.slot_mapping[11:].tolist() == [3, 0, 1, 2, 3]  # padding token j: slot j % 4 of page 0
    assert si.cu_q_lens.tolist() == [0, 5, 11]
    assert si.kv_lens.tolist() == [5, 6]
    assert si.page_indices.tolist() == [[1, 2], [3, 4]]
    assert si.logits_indices.tolist() == [4, 10]
    assert si.sample_positions.tolist() == [5, 6]
    assert si.temperature.tolist() == pytest.approx([0.0, 0.7])
    assert si.top_k.tolist() == [0, 0] and si.top_p.tolist() == pytest.approx([1.0, 0.9])
    assert si.min_p.tolist() == pytest.approx([0.0, 0.1])
    assert si.seeds.dtype == np.uint32 and si.seeds.tolist() == [0, 5]
    assert not si.all_greedy and not si.needs_logprobs
    assert si.prompt_token_ids is None and si.bias_token_ids is None


def test_padding_sequences_and_rows():
    cfg = make_config(page_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    reqs = [make_request(n, range(10 * i + 10, 10 * i + 13)) for i, n in enumerate("abc")]
    _, out = schedule_one_step(cfg, reqs)
    si = make_step_input(out, cfg, 64)
    assert si.shape == (16, 4, 1)
    assert si.cu_q_lens.tolist() == [0, 3, 6, 9, 9]  # the padded seq repeats the last value
    assert si.kv_lens.tolist() == [3, 3, 3, 0]
    assert si.page_indices[3].tolist() == [0]
    assert si.logits_indices[3] == 0 and si.temperature[3] == 0 and si.repetition_penalty[3] == 1
    assert si.all_greedy is False  # default temperature 1.0


def test_positions_and_slots_after_a_prefix_hit():
    cfg = make_config(page_size=4, max_num_batched_tokens=16)
    shared = list(range(30, 38))
    warm = make_request("w", shared + [1, 2])
    b = make_request("b", shared + [3, 4, 5])
    sched, out = schedule_one_step(cfg, [b], warm=[warm])
    si = make_step_input(out, cfg, 64)
    row = [s.request.request_id for s in out.scheduled].index("b")
    lo, hi = si.cu_q_lens[row], si.cu_q_lens[row + 1]
    assert hi - lo == 3
    assert si.positions[lo:hi].tolist() == [8, 9, 10]
    assert si.input_ids[lo:hi].tolist() == [3, 4, 5]
    assert b.page_ids[:2] == warm.page_ids[:2]
    assert si.slot_mapping[lo:hi].tolist() == [b.page_ids[2] * 4 + o for o in (0, 1, 2)]
    assert si.kv_lens[row] == 11 and si.sample_positions[row] == 11


def test_mid_prompt_chunk_row_points_at_its_last_token():
    cfg = make_config(page_size=4, max_num_batched_tokens=8)
    a = make_request("a", range(10, 30))
    _, out = schedule_one_step(cfg, [a])
    si = make_step_input(out, cfg, 64)
    assert not out.scheduled[0].samples
    assert si.logits_indices.tolist() == [7] and si.kv_lens.tolist() == [8]


def test_optional_penalty_bias_and_logprob_inputs():
    cfg = make_config(page_size=4, max_num_batched_tokens=16)
    a = make_request("a", range(10, 13), repetition_penalty=1.2, logit_bias={"7": 3.0}, logprobs=5)
    b = make_request("b", range(20, 22), min_tokens=2, stop_token_ids=[9], logprobs=0)
    c = make_request("c", range(30, 32))
    _, out = schedule_one_step(cfg, [a, b, c])
    si = make_step_input(out, cfg, 64)
    assert si.needs_logprobs and si.num_top_logprobs == 5
    assert si.repetition_penalty[:3].tolist() == pytest.approx([1.2, 1.0, 1.0])
    assert si.prompt_token_ids.shape == (4, 8) and si.prompt_token_ids[0, :4].tolist() == [10, 11, 12, -1]
    assert si.output_token_ids.shape == (4, 8) and (si.output_token_ids == -1).all()
    bias = {(r, int(t)): float(v) for r in range(4) for t, v in zip(si.bias_token_ids[r], si.bias_values[r]) if v}
    assert bias == {(0, 7): 3.0, (1, 9): float("-inf"), (1, EOS): float("-inf")}


def test_pack_unpack_round_trip():
    cfg = make_config(page_size=4, max_num_batched_tokens=16)
    a = make_request("a", range(10, 15), temperature=0.5, seed=2**32 - 1, presence_penalty=0.5)
    _, out = schedule_one_step(cfg, [a])
    si = make_step_input(out, cfg, 64)
    buf, layout = si.pack()
    assert buf.dtype == np.int32 and buf.ndim == 1
    hash(layout)  # static-argument friendly
    arrays = unpack(buf, layout, lambda x, d: x.view(d))
    assert set(arrays) == set(si.array_fields())
    for name, x in arrays.items():
        ref = getattr(si, name)
        assert x.dtype == ref.dtype and x.shape == ref.shape and np.array_equal(x, ref), name
    assert arrays["seeds"].tolist() == [2**32 - 1]


def test_empty_step_input_only_touches_the_null_page():
    si = empty_step_input(16, 4, 2, page_size=8)
    assert si.slot_mapping.max() < 8 and si.num_seqs.tolist() == [0]
    assert si.cu_q_lens.tolist() == [0] * 5 and not si.page_indices.any()


def test_make_step_input_with_coarse_buckets():
    cfg = make_config(page_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    reqs = [make_request(n, range(10 * i + 10, 10 * i + 13)) for i, n in enumerate("abc")]
    _, out = schedule_one_step(cfg, reqs)
    si = make_step_input(out, cfg, 64, buckets=StepBuckets.coarse(cfg, 64))
    assert si.shape == (16, 4, 16)
    assert si.kv_lens.tolist() == [3, 3, 3, 0] and si.page_indices[:, 1:].sum() == 0
