"""The memory-mapping budget: an engine whose executables would pass vm.max_map_count refuses
with an error that names the limit, instead of crashing in XLA:CPU."""

from __future__ import annotations

import os

import pytest

from jaxinfer.engine.client import StepFailed
from jaxinfer.runtime import memory_maps
from jaxinfer.sampling_params import SamplingParams

linux_only = pytest.mark.skipif(not os.path.exists(memory_maps.MAPS_FILE),
                                reason="no /proc/self/maps here")


def test_room_error_fits_and_overflows():
    assert memory_maps.room_error(10, 500.0, used=1_000, cap=65_530) is None
    error = memory_maps.room_error(118, 555.0, used=1_000, cap=65_530)
    assert "vm.max_map_count" in error and "65,490" in error and "65,530" in error
    assert "118 more step executable(s)" in error and "~555 each" in error
    # the headroom is kept: exactly full is too full
    cap = 1_000 + 10 * 500 + memory_maps.HEADROOM
    assert memory_maps.room_error(10, 500.0, used=1_000, cap=cap) is None
    assert memory_maps.room_error(10, 500.0, used=1_001, cap=cap) is not None


def test_room_error_unknown_is_no_error():
    assert memory_maps.room_error(10, 500.0, used=None, cap=65_530) is None
    assert memory_maps.room_error(10, 500.0, used=1_000, cap=None) is None
    assert memory_maps.room_error(10, 0.0, used=64_000, cap=65_530) is None  # not measured yet


@linux_only
def test_counts_are_read():
    assert memory_maps.in_use() > 10
    assert memory_maps.limit() > 1_000


@linux_only
def test_engine_refuses_executables_past_the_limit(tiny_llama_dir, monkeypatch):
    from jaxinfer.engine import LLMEngine

    engine = LLMEngine(tiny_llama_dir, num_pages=32, page_size=8, max_num_seqs=4,
                       max_num_batched_tokens=32, max_model_len=64)
    # room for what the process holds now and nothing more: the first executable (which is
    # measured) still compiles, the next ones must not
    cap = memory_maps.in_use() + memory_maps.HEADROOM
    monkeypatch.setattr(memory_maps, "limit", lambda: cap)
    with pytest.raises(RuntimeError, match=r"vm\.max_map_count") as info:
        engine.warmup()
    assert "max_num_seqs" in str(info.value)
    assert engine.runner.num_compilations == 1
    assert engine.runner.maps_per_executable > 0

    # a step whose shape is not compiled yet fails alone; the engine goes on once there is room
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request("over", [5, 6, 7, 8, 9, 10, 11, 12, 13], params)
    with pytest.raises(StepFailed, match=r"vm\.max_map_count") as failed:
        while engine.has_unfinished_requests():
            engine.step()
    assert failed.value.request_ids == ("over",)
    assert not engine.has_unfinished_requests()
    monkeypatch.setattr(memory_maps, "limit", lambda: None)
    engine.add_request("after", [5, 6, 7, 8, 9, 10, 11, 12, 13], params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.request_id for o in outputs if o.finished] == ["after"]
    assert len([o for o in outputs if o.finished][0].outputs[0].token_ids) == 3
    assert engine.scheduler.pool.num_used_pages == 0
