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


def run_checks(num_devices: int, model_dir: str, *checks: str, timeout: float = 600) -> str:
    """Runs `python -m tests.scale_out_checks model_dir checks...` on `num_devices` fake CPU
    devices; returns its stdout, failing the test with its output when it fails."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={num_devices}",
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


def test_one_engine_over_two_processes(tiny_llama_dir):
    """Two processes of one CPU device each (gloo collectives) as one tp=2 engine, its C++
    attention kernels run per device: process 0's tokens equal a one-device engine's, process 1
    follows its steps until it stops them."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for pid in range(2):
        env = dict(os.environ, JAX_PLATFORMS="cpu", JAXINFER_NUM_PROCESSES="2",
                   JAXINFER_PROCESS_ID=str(pid), JAXINFER_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                   PYTHONPATH=str(_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("XLA_FLAGS", None)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tests.scale_out_checks", tiny_llama_dir, "multi_process"],
            cwd=_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        results = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, f"{out}\n{err[-6000:]}"
    assert "ok leader cpu" in results[0][0] and "ok follower" in results[1][0], results
