"""Tensor and data parallelism on fake CPU devices: each check runs in a subprocess that sets
XLA_FLAGS=--xla_force_host_platform_device_count before importing jax (this process has one
device). The checks themselves are in tests/scale_out_checks.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny_models import save_tiny_model

_ROOT = Path(__file__).resolve().parent.parent


def _xla_flags(*extra: str) -> str:
    """The suite's XLA_FLAGS (tests/conftest.py's) without a device count, plus `extra`."""
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join(kept + list(extra))


def run_checks(num_devices: int, model_dir: str, *checks: str, timeout: float = 600) -> str:
    """Runs `python -m tests.scale_out_checks model_dir checks...` on `num_devices` fake CPU
    devices; returns its stdout, failing the test with its output when it fails."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=_xla_flags(f"--xla_force_host_platform_device_count={num_devices}"),
               PYTHONPATH=str(_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "tests.scale_out_checks", model_dir, *checks],
                          cwd=_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        pytest.fail(f"scale-out checks {checks} failed:\n{proc.stdout}\n{proc.stderr[-6000:]}")
    return proc.stdout


def test_tensor_parallel_matches_one_device(tiny_llama_dir):
    """tp=2 = tp=1 greedy tokens on the C++ kernels (the CPU's default backend, run per device
    under shard_map), with float and int8 weights, and on the XLA and Pallas (interpreted)
    backends; weights and KV cache split by head; a KV-head count that tp does not divide raises
    ValueError naming it."""
    out = run_checks(2, tiny_llama_dir, "tp", "tp:quantization=int8", "tp:attention_backend=xla",
                     "tp:attention_backend=pallas", "tp_bad_heads")
    assert out.count("ok") == 5, out
    assert "ok tp 2 cpu" in out and "ok tp 2 xla" in out and "ok tp 2 pallas" in out, out


def test_tensor_parallel_kernels_per_device(tiny_llama_dir):
    """tp=2 on the C++ kernels: tp=1's greedy tokens through chunked prefill and prefix-cache
    hits; the compiled step runs the attention custom call on each device's own heads, keeps 2
    all-reduces per layer and gathers no weight and no KV cache."""
    out = run_checks(2, tiny_llama_dir, "tp_chunked", "tp_hlo", "tp_hlo:attention_backend=xla")
    assert "ok tp chunked cpu" in out and "ok tp hlo cpu" in out and "ok tp hlo xla" in out, out


@pytest.fixture(scope="module")
def wide_llama_dir(tmp_path_factory) -> str:
    """A tiny llama whose o_proj / down_proj (K = 128 / 256) split in 2 into rows the int4
    kernel takes (K / 2 per device a multiple of the group of 32)."""
    return save_tiny_model("llama", tmp_path_factory.mktemp("wide") / "llama", seed=0,
                           hidden_size=128, intermediate_size=256)


def test_tensor_parallel_quantized_kernels_per_device(wide_llama_dir, tmp_path):
    """Quantized weights at tp=2 on the C++ kernels: each device multiplies by its own share of
    the codes (qkv / gate_up / the head by column, o_proj / down_proj by row, int4 rows packed
    per device) and tp=1's greedy tokens come out, for int8 (per channel), int4 (groups of 32,
    a quantized head), on Pallas (interpreted), and for a GGUF file's Q4_1 tensors as stored;
    the compiled step calls the quantized-matmul kernel on local shapes, keeps 2 all-reduces
    per layer and gathers no weight."""
    from tests.tiny_models import save_tiny_gguf

    gguf = save_tiny_gguf(wide_llama_dir, tmp_path / "q4_1.gguf", "Q4_1")
    gguf_checks = (f"tp:model={gguf},tokenizer={wide_llama_dir}",
                   f"tp_hlo:model={gguf},tokenizer={wide_llama_dir}")
    out = run_checks(2, wide_llama_dir, "tp:quantization=int8", "tp:quantization=int4",
                     "tp:quantization=int4,quantize_lm_head=true,attention_backend=pallas",
                     "tp_hlo:quantization=int8", "tp_hlo:quantization=int4,quantize_lm_head=true",
                     *gguf_checks)  # one process: its start-up (jax, kernels) paid once
    oks = [line for line in out.splitlines() if line.startswith("ok")]  # one per check, in order
    assert len(oks) == 7, out
    wide, q4_1 = "\n".join(oks[:5]), "\n".join(oks[5:])
    assert wide.count("ok tp 2 cpu") == 2 and "ok tp 2 pallas" in wide, out
    assert "8 quantized matmuls per device" in wide and "9 quantized matmuls" in wide, out
    assert "ok tp 2 cpu" in q4_1 and "9 quantized matmuls per device" in q4_1, out


def test_quantized_split_is_exact_or_refused():
    """Which quantized weights split per device: a row split must fall on whole groups of K
    (and, for int4, an even number of rows a device); per-channel int8 rows always do."""
    from jaxinfer.ops.sharded_matmul import COLUMN, ROW, split_problem

    assert split_problem(COLUMN, 4, 32, (576, 960), 3) is None
    assert "N=960" in split_problem(COLUMN, 8, 576, (576, 960), 7)
    assert split_problem(ROW, 8, 576, (576, 576), 3) is None  # per channel: scales shared
    assert split_problem(ROW, 4, 32, (576, 576), 3) is None  # 192 rows: 6 groups, 96 bytes
    assert "whole groups of 128" in split_problem(ROW, 4, 128, (576, 576), 2)  # 4.5 groups
    assert "even" in split_problem(ROW, 4, 32, (66, 64), 2)  # 33 rows: half a byte each
    assert "K=64" in split_problem(ROW, 8, 32, (64, 64), 3)


def test_int4_rows_packed_per_shard():
    """Each device's block of repacked codes is the natural packing of its own rows."""
    import numpy as np

    from jaxinfer.models.tp_layout import int4_rows_packed_per_shard
    from jaxinfer.quant import pack_int4
    from jaxinfer.quant.format import unpacked_int4

    q = np.random.default_rng(0).integers(0, 16, size=(2, 96, 5)).astype(np.uint8)  # [L, K, N]
    repacked = np.asarray(int4_rows_packed_per_shard(pack_int4(q), 96, 3))
    assert repacked.shape == (2, 48, 5)
    for j in range(3):
        block = repacked[:, j * 16:(j + 1) * 16]
        np.testing.assert_array_equal(np.asarray(unpacked_int4(block, 32)), q[:, j * 32:(j + 1) * 32])


def test_tensor_parallel_smollm2(smollm2_gguf):
    """SmolLM2-135M (9 query heads over 3 KV heads, tied embeddings, Q8_0 weights as stored) at
    tp=3: each device runs the C++ kernel on 3 query heads and their one KV head; tp=1's greedy
    tokens."""
    out = run_checks(3, smollm2_gguf, "tp:tp=3")
    assert "ok tp 3 cpu" in out, out


def test_data_parallel_matches_one_engine(tiny_llama_dir):
    """2 replicas on 2 devices: one engine's greedy tokens, requests spread over both, a cached
    prefix draws its follow-up to the replica holding it."""
    out = run_checks(2, tiny_llama_dir, "dp")
    assert "ok dp" in out, out


def test_tensor_times_data_parallel(tiny_llama_dir):
    """tp=2 x dp=2 on 4 devices: disjoint 2-device meshes, one engine's greedy tokens."""
    out = run_checks(4, tiny_llama_dir, "tp_dp")
    assert "ok tp x dp" in out, out


def test_parallel_flags_come_from_engine_config():
    from jaxinfer.config_args import engine_flags

    options = {o for flag in engine_flags() for o in flag.option_strings}
    assert {"--tensor-parallel-size", "--data-parallel-size"} <= options


def _two_processes(model_dir: str, check: str, timeout: float = 600) -> list[tuple]:
    """Runs `python -m tests.scale_out_checks model_dir check` as processes 0 and 1 of one
    engine (one CPU device each, gloo collectives over loopback). -> per process (status,
    stdout, stderr, time.time() at which it was seen to end)."""
    import socket
    import tempfile
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs, logs, ended = [], [], [None, None]
    try:
        for pid in range(2):
            env = dict(os.environ, JAX_PLATFORMS="cpu", JAXINFER_NUM_PROCESSES="2",
                       JAXINFER_PROCESS_ID=str(pid),
                       JAXINFER_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                       PYTHONPATH=str(_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
            env["XLA_FLAGS"] = _xla_flags()  # one device each
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            logs.append((out, err))
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tests.scale_out_checks", model_dir, check],
                cwd=_ROOT, env=env, stdout=out, stderr=err, text=True))
        deadline = time.monotonic() + timeout
        while None in ended and time.monotonic() < deadline:
            for i, p in enumerate(procs):
                if ended[i] is None and p.poll() is not None:
                    ended[i] = time.time()
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    results = []
    for p, (out, err), t in zip(procs, logs, ended):
        out.seek(0)
        err.seek(0)
        results.append((p.wait(), out.read(), err.read(), t))
    assert None not in ended, f"a process did not end in {timeout} s: {results}"
    return results


def test_one_engine_over_two_processes(tiny_llama_dir):
    """Two processes of one CPU device each (gloo collectives) as one tp=2 engine, its C++
    attention kernels run per device: process 0's tokens equal a one-device engine's, process 1
    follows its steps until it stops them."""
    results = _two_processes(tiny_llama_dir, "multi_process")
    for status, out, err, _ in results:
        assert status == 0, f"{out}\n{err[-6000:]}"
    assert "ok leader cpu" in results[0][1] and "ok follower" in results[1][1], results


def _failed_at(out: str) -> float:
    return float(out.split("failing at ")[1].split()[0])


def test_two_processes_leader_failure_ends_follower(tiny_llama_dir):
    """Process 0 raises between steps: it broadcasts the error instead of the next step, and
    process 1 raises LeaderFailed with it; both end with status 1, seconds apart (not after
    jax.distributed's 100 s heartbeat or 5-minute shutdown timeouts)."""
    (leader, lout, lerr, lend), (follower, fout, ferr, fend) = _two_processes(
        tiny_llama_dir, "multi_process_failure:fails=leader")
    assert leader == 1 and "leader failed on purpose" in lerr, f"{lout}\n{lerr[-6000:]}"
    assert follower == 1, f"{fout}\n{ferr[-6000:]}"
    assert "LeaderFailed: process 0 ended the engine after" in ferr, ferr[-6000:]
    assert "RuntimeError: leader failed on purpose" in ferr, ferr[-6000:]
    assert "follower returned" not in fout
    assert fend - _failed_at(lout) < 60 and lend - _failed_at(lout) < 60, (lend, fend, lout)


def test_two_processes_follower_failure_ends_leader(tiny_llama_dir):
    """Process 1's step raises: it leaves at once with the error, process 0's step (waiting in
    that step's collectives) fails with a RuntimeError saying another process left, and
    process 0 leaves too; both with status 1, seconds apart."""
    (leader, lout, lerr, lend), (follower, fout, ferr, fend) = _two_processes(
        tiny_llama_dir, "multi_process_failure:fails=follower")
    assert follower == 1, f"{fout}\n{ferr[-6000:]}"
    assert "process 1 leaves the multi-process engine after 3 steps: RuntimeError: follower " \
           "failed on purpose" in ferr, ferr[-6000:]
    assert leader == 1, f"{lout}\n{lerr[-6000:]}"
    assert "the multi-process engine failed: another process of the engine left" in lerr, \
        lerr[-6000:]
    assert "process 0 leaves the multi-process engine" in lerr, lerr[-6000:]
    assert "leader returned" not in lout
    assert lend - _failed_at(fout) < 60 and fend - _failed_at(fout) < 60, (lend, fend, fout)
