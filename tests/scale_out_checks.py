"""Multi-device checks of tensor and data parallelism, run in a subprocess with fake CPU devices.

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m tests.scale_out_checks DIR tp \
        tp:quantization=int8 tp:attention_backend=xla tp_chunked tp_hlo tp_bad_heads

(tests/test_scale_out.py runs them: the flag must be set before jax is imported, and the test
process itself has one device.) Each check raises AssertionError on a mismatch and prints `ok`.
"""

from __future__ import annotations

import sys

_PROMPTS = ["The quick brown fox", "Hello, world! How are", "Paged attention keeps the KV",
            "Once upon a time there was"]


def _greedy(llm, prompts=_PROMPTS, max_tokens=12):
    from jaxinfer.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _heads_per_device(array, axis: int) -> set[int]:
    return {shard.data.shape[axis] for shard in array.addressable_shards}


def _kv_head_axis(engine) -> int:
    """The axis of the KV-head split of the engine's cache (its backend's layout)."""
    from jaxinfer import ops
    from jaxinfer.ops.sharded import kv_cache_spec

    kv = engine.runner.kv_cache.k
    spec = kv_cache_spec(kv.ndim, ops.head_major_cache(engine.runner.attention_backend))
    got = tuple(kv.sharding.spec) + (None,) * (kv.ndim - len(kv.sharding.spec))
    assert got == tuple(spec), (kv.sharding, spec)
    return list(spec).index("tp")


def check_tp(model_dir: str, tp: int = 2, **engine_kwargs) -> None:
    """tp devices give tp=1's greedy tokens on the same attention backend (the kernels run per
    device under shard_map); weights and KV cache are split by head over the devices."""
    import warnings

    import jax

    from jaxinfer.llm import LLM

    assert len(jax.devices()) >= tp, jax.devices()
    # a kernel's silent fallback to the XLA path would make a kernel backend's check vacuous
    warnings.filterwarnings("error", message="pallas .* unavailable")
    base = dict(num_pages=64, max_num_seqs=4, max_model_len=128, **engine_kwargs)
    one = LLM(model_dir, **base)
    want = _greedy(one)
    llm = LLM(model_dir, tensor_parallel_size=tp, **base)
    got = _greedy(llm)
    assert got == want, (got, want)
    engine = llm.engine
    mc = engine.model_config
    assert engine.runner.attention_backend == one.engine.runner.attention_backend
    assert engine.runner.flags.mesh is not None and engine.runner.flags.mesh.devices.size == tp
    attn = engine.runner.state["layers"][0]["self_attn"]
    qkv = attn["qkv_proj"]
    leaf = qkv["weight"] if "weight" in qkv else qkv["values"]
    per_device = (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim // tp
    assert leaf.sharding.spec[-1] == "tp", leaf.sharding
    assert {s.data.shape[-1] for s in leaf.addressable_shards} == {per_device}
    assert len({s.device for s in leaf.addressable_shards}) == tp
    kv = engine.runner.kv_cache  # after the steps above: still split by KV head
    axis = _kv_head_axis(engine)
    assert _heads_per_device(kv.k, axis) == {mc.num_kv_heads // tp}, kv.k.sharding
    assert _heads_per_device(kv.v, axis) == {mc.num_kv_heads // tp}, kv.v.sharding
    print("ok tp", tp, engine.runner.attention_backend, engine_kwargs, got[0])


def check_tp_chunked(model_dir: str, **engine_kwargs) -> None:
    """tp=2 = tp=1 greedy tokens with prompts prefilled in chunks (a 16-token step budget over
    4-token pages) and, in a second round, prompts whose leading pages are prefix-cache hits."""
    import numpy as np

    from jaxinfer.llm import LLM
    from jaxinfer.sampling_params import SamplingParams

    rng = np.random.default_rng(7)
    first = [rng.integers(3, 300, size=n).tolist() for n in (1, 7, 19, 45)]
    second = [first[3][:40] + rng.integers(3, 300, size=5).tolist(), first[2] + [17, 18]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    base = dict(num_pages=96, page_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                max_model_len=128, **engine_kwargs)

    def run(llm):
        outs = [llm.generate(p, params, use_tqdm=False) for p in (first, second)]
        return ([o.outputs[0].token_ids for o in outs[0] + outs[1]],
                [o.metrics.num_cached_tokens for o in outs[1]])

    want, want_cached = run(LLM(model_dir, **base))
    llm = LLM(model_dir, tensor_parallel_size=2, **base)
    got, cached = run(llm)
    assert got == want, (got, want)
    assert cached == want_cached and min(cached) >= 16, (cached, want_cached)  # prefix hits
    print("ok tp chunked", llm.engine.runner.attention_backend, engine_kwargs, cached)


def check_tp_hlo(model_dir: str, **engine_kwargs) -> None:
    """The compiled tp=2 decode step: the attention kernel (C++ custom call) runs on each
    device's own heads, 2 all-reduces of the activations per layer (after o_proj and down_proj;
    one more for the vocabulary-sharded embedding lookup), and no collective moves a weight
    matrix or the KV cache (only activations and the sampler's logits). With quantized weights
    the C++ quantized matmul runs on each device's share of every layer: x and codes of local
    shapes (`_check_quant_calls`)."""
    import re

    import jax
    import numpy as np

    from jaxinfer.llm import LLM
    from jaxinfer.sched.step_input import warmup_step_inputs

    llm = LLM(model_dir, tensor_parallel_size=2, num_pages=64, max_num_seqs=4, max_model_len=128,
              **engine_kwargs)
    engine, runner = llm.engine, llm.engine.runner
    mc = engine.model_config
    si = next(iter(warmup_step_inputs(engine.engine_config, engine.max_model_len,
                                      buckets=engine.buckets,
                                      bitmask_words=engine.bitmask_words)))  # the decode bucket
    compiled, _ = runner._prepare(si)  # the step's executable for this bucket, as execute runs it
    hlo = compiled.as_text()
    shapes = {}  # instruction name -> result dims
    ops = []  # (op, result shape dims, custom-call target, operand names)
    for line in hlo.splitlines():
        d = re.match(r"\s*(?:ROOT )?(%\S+) = \w+\[([\d,]*)\]", line)
        if d:
            shapes[d.group(1)] = tuple(int(v) for v in d.group(2).split(",") if v)
        m = re.search(r"= \w+\[([\d,]*)\]\S* (all-reduce|all-gather|all-to-all|"
                      r"collective-permute|reduce-scatter|custom-call)(?:-start)?\(([^)]*)\)", line)
        if m:
            target = re.search(r'custom_call_target="([^"]+)"', line)
            dims = tuple(int(d) for d in m.group(1).split(",") if d)
            operands = re.findall(r"%[\w.\-]+", m.group(3))
            ops.append((m.group(2), dims, target.group(1) if target else "", operands))
    num_tokens = si.shape[0]
    if runner.attention_backend == "cpu":
        kernels = [dims for op, dims, target, _ in ops if "RaggedPagedAttention" in target]
        local = (num_tokens, mc.num_heads // 2, mc.head_dim)  # one device's query heads
        assert kernels == [local] * mc.num_layers, (kernels, local)
    quant = [(shapes[args[0]], shapes[args[1]], dims) for op, dims, target, args in ops
             if "QuantMatmul" in target]
    if engine_kwargs.get("quantization") or quant:
        _check_quant_calls(quant, engine)
    reduces = [dims for op, dims, _, _ in ops if op == "all-reduce"
               and int(np.prod(dims)) == num_tokens * mc.hidden_size]
    assert len(reduces) == 2 * mc.num_layers + 1, reduces
    matrices = [leaf.size for path, leaf in jax.tree_util.tree_leaves_with_path(runner.state)
                if leaf.ndim >= 2 and "scales" not in str(path) and "mins" not in str(path)]
    moved = [(op, dims) for op, dims, _, _ in ops if op != "custom-call"]
    big = [(op, dims) for op, dims in moved if int(np.prod(dims)) >= min(matrices)]
    assert not big, big  # a gathered weight or KV cache would be at least this large
    print("ok tp hlo", runner.attention_backend, len(reduces), "all-reduces of activations,",
          len(moved), "collectives,", len(quant), "quantized matmuls per device")


def _check_quant_calls(calls: list, engine) -> None:
    """calls: (x dims, codes dims, output dims) of each C++ quantized matmul of the tp=2 step:
    one per projection of every layer (and the LM head when quantized), each on one device's
    share: qkv / gate_up / the head by output column, o_proj / down_proj by input row."""
    import jax

    mc = engine.model_config
    h, i, v = mc.hidden_size, mc.intermediate_size, mc.vocab_size
    qkv, q = (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim, mc.num_heads * mc.head_dim
    local = {(h, qkv // 2), (q // 2, h), (h, i), (i // 2, h)}  # (K, N) per device; gate_up 2I/2
    paths = [str(p) for p, _ in jax.tree_util.tree_leaves_with_path(engine.runner.state)]
    head = any("values" in p and ("lm_head" in p or "embed_tokens" in p) for p in paths)
    if head:
        local.add((h, v // 2))
    got = {(x[1], out[1]) for x, _, out in calls}
    assert got == local, (sorted(got), sorted(local))
    for x, codes, out in calls:
        assert x[0] == out[0], (x, out)
        assert codes in ((x[1], out[1]), (x[1] // 2, out[1])), (x, codes, out)  # int8 | int4
    assert len(calls) == 4 * mc.num_layers + head, calls


def check_tp_bad_heads(model_dir: str) -> None:
    """A head count tp does not divide -> ValueError naming the counts."""
    from jaxinfer.llm import LLM

    try:
        LLM(model_dir, tensor_parallel_size=4, num_pages=16, max_model_len=64)
    except ValueError as e:
        assert "num_kv_heads=2" in str(e) and "tensor_parallel_size=4" in str(e), e
        print("ok bad heads:", e)
        return
    raise AssertionError("tensor_parallel_size=4 over 2 KV heads did not raise")


def check_dp(model_dir: str, **engine_kwargs) -> None:
    """2 replicas (one device each) give one engine's greedy tokens; requests land on both; a
    prompt whose prefix one replica has cached goes there."""
    import jax

    from jaxinfer.engine.replicas import ReplicatedEngine
    from jaxinfer.llm import LLM

    base = dict(num_pages=64, max_num_seqs=4, max_model_len=128, page_size=4, **engine_kwargs)
    want = _greedy(LLM(model_dir, **base))
    llm = LLM(model_dir, data_parallel_size=2, **base)
    engine = llm.engine
    assert isinstance(engine, ReplicatedEngine)
    got = _greedy(llm)
    assert got == want, (got, want)
    assert engine.num_routed == [2, 2], engine.num_routed
    devices = [{d for leaf in jax.tree.leaves(r.runner.kv_cache) for d in leaf.devices()}
               for r in engine.replicas]
    assert devices[0].isdisjoint(devices[1]) and all(len(d) == 1 for d in devices), devices
    # prefix-cache preference: with both idle, ties go to replica 0; a prompt whose pages
    # replica 1 has cached goes to replica 1
    assert not engine._owner, engine._owner  # finished requests are forgotten
    filler, shared = "def main(): print('count 1, 2, 3')", "JAX is a library for array computing"
    before = list(engine.num_routed)
    llm.generate([filler, shared], use_tqdm=False)  # filler -> 0 (tie), shared -> 1 (less load)
    assert [a - b for a, b in zip(engine.num_routed, before)] == [1, 1], engine.num_routed
    llm.generate([shared + " and program transformation."], use_tqdm=False)
    assert engine.num_routed[1] == before[1] + 2, (engine.num_routed, before)
    print("ok dp", engine_kwargs, engine.num_routed)


def check_tp_dp(model_dir: str, **engine_kwargs) -> None:
    """tp=2 x dp=2 on 4 devices: replicas each on a 2-device mesh, one engine's tokens."""
    from jaxinfer.llm import LLM

    base = dict(num_pages=64, max_num_seqs=4, max_model_len=128, **engine_kwargs)
    want = _greedy(LLM(model_dir, **base))
    llm = LLM(model_dir, tensor_parallel_size=2, data_parallel_size=2, **base)
    got = _greedy(llm)
    assert got == want, (got, want)
    meshes = [r.mesh for r in llm.engine.replicas]
    assert [m.devices.size for m in meshes] == [2, 2]
    assert not set(meshes[0].devices.flat) & set(meshes[1].devices.flat)
    print("ok tp x dp", llm.engine.num_routed)


def check_multi_process(model_dir: str) -> None:
    """One engine over 2 processes of 1 CPU device each (JAXINFER_* environment variables set
    by the caller): process 0 compares its tokens with its own 1-device engine's, process 1
    follows its steps."""
    import jax

    from jaxinfer.engine.replicas import run_follower
    from jaxinfer.llm import LLM

    # few buckets: 8 tokens a step (7 step shapes, 14 with the bitmask layouts, against 26 at
    # 64), so the 11-15-token prompts prefill in chunks, on both engines alike
    base = dict(max_num_seqs=2, max_model_len=64, max_num_batched_tokens=8)
    # joins the job; pool sized by both; warm-up compiles every bucket on both, in step
    llm = LLM(model_dir, tensor_parallel_size=2, warmup=True, **base)
    assert jax.process_count() == 2 and len(jax.local_devices()) == 1
    if run_follower(llm.engine):
        print("ok follower")
        return
    got = _greedy(llm)
    kv = llm.engine.runner.kv_cache.k
    assert _heads_per_device(kv, _kv_head_axis(llm.engine)) == {1}, kv.sharding  # 1 of 2 heads
    assert llm.engine.num_pages == 2 * (64 // 16) + 1, llm.engine.num_pages  # 2 full contexts
    want = _greedy(LLM(model_dir, num_pages=64, **base))  # this process's device only
    assert got == want, (got, want)
    llm.engine.runner.stop_followers()
    print("ok leader", llm.engine.runner.attention_backend, got[0])


def check_multi_process_failure(model_dir: str, fails: str) -> None:
    """One engine over 2 processes (as check_multi_process) in which `fails` ("leader" or
    "follower") raises after a few steps, printing `failing at <time>` first: both processes
    must then end with status 1 and the error (tests/test_scale_out.py reads their output)."""
    import time

    import jax

    from jaxinfer.engine.replicas import run_follower
    from jaxinfer.llm import LLM

    llm = LLM(model_dir, tensor_parallel_size=2, max_num_seqs=2, max_model_len=64,
              max_num_batched_tokens=64)
    runner = llm.engine.runner
    if jax.process_index() == 1:
        if fails == "follower":
            step_args, calls = runner._step_args, []

            def failing(*args):
                calls.append(1)
                if len(calls) == 4:
                    print("failing at", time.time(), flush=True)
                    raise RuntimeError("follower failed on purpose")
                return step_args(*args)

            runner._step_args = failing
        run_follower(llm.engine)
        print("follower returned")  # not expected: the leader failed
        return
    _greedy(llm, max_tokens=4)
    if fails == "leader":
        print("failing at", time.time(), flush=True)
        raise RuntimeError("leader failed on purpose")
    _greedy(llm, max_tokens=4)  # the follower's 4th step fails: so does this
    print("leader returned")  # not expected


def _value(text: str):
    if text in ("true", "false"):
        return text == "true"
    try:
        return int(text)
    except ValueError:
        return text


if __name__ == "__main__":
    # python -m tests.scale_out_checks DIR CHECK[:key=value,...] ...  (model=PATH: that check's
    # model instead of DIR, so checks of several models share one process and its start-up)
    checks = {"tp": check_tp, "tp_chunked": check_tp_chunked, "tp_hlo": check_tp_hlo,
              "tp_bad_heads": check_tp_bad_heads, "dp": check_dp,
              "tp_dp": check_tp_dp, "multi_process": check_multi_process,
              "multi_process_failure": check_multi_process_failure}
    model_dir, *specs = sys.argv[1:]
    for spec in specs:
        name, _, flags = spec.partition(":")
        kwargs = {k: _value(v) for k, v in (f.split("=", 1) for f in flags.split(",") if f)}
        checks[name](kwargs.pop("model", model_dir), **kwargs)
