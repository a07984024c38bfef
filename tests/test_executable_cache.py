"""Warm-up compiles every bucket ahead of time; the executable cache (runtime/executable_cache.py)
lets a second engine load them instead of tracing: same tokens as compiling, no compile after
warm-up, damaged entries compiled afresh, other settings other keys."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.runtime import executable_cache
from jaxinfer.runtime.executable_cache import ExecutableCache
from jaxinfer.sched.step_input import warmup_step_inputs
from jaxinfer.structured import bitmask_words

# Two sequences and 4 tokens a step: 5 shape buckets (10 executables with the bitmask layouts),
# among them T > S, a chunked prefill and a batch of two, each engine compiling or loading them all.
SETTINGS = dict(num_pages=32, page_size=8, max_num_seqs=2, max_num_batched_tokens=4,
                max_model_len=64)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [20, 21], [30, 31, 32, 33]]
PARAMS = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=6, temperature=1.0, top_p=0.8, seed=7, ignore_eos=True),
          SamplingParams(max_tokens=6, temperature=0.7, seed=3, logprobs=3, ignore_eos=True)]


def _outputs(llm):
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def _num_buckets(llm) -> int:
    e = llm.engine
    return len(list(warmup_step_inputs(e.engine_config, e.max_model_len, buckets=e.buckets,
                                       bitmask_words=bitmask_words(e.vocab_size))))


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    return tmp_path_factory.mktemp("executables")


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """Outputs of an engine that compiles on first use (no warm-up, no cache)."""
    llm = LLM(tiny_llama_dir, **SETTINGS)
    assert llm.engine.runner._executable_cache is None  # JAX's cache is off in the tests
    return _outputs(llm)


def _cached_llm(tiny_llama_dir, root, monkeypatch, **overrides):
    monkeypatch.setattr(ExecutableCache, "from_jax_config", classmethod(lambda cls: cls(root)))
    return LLM(tiny_llama_dir, warmup=True, **{**SETTINGS, **overrides})


def test_warmup_compiles_then_a_second_engine_loads(tiny_llama_dir, cache_root, reference,
                                                    monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="jaxinfer.runtime.runner"):
        first = _cached_llm(tiny_llama_dir, cache_root, monkeypatch)
    n = _num_buckets(first)
    assert caplog.text.count("compiled a step for") == n
    assert len(list(cache_root.glob("*/*.jaxexe"))) == n
    assert first.engine.metrics.num_compilations == n
    assert _outputs(first) == reference
    assert first.engine.metrics.num_compilations == n  # flat after warm-up
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="jaxinfer.runtime.runner"):
        second = _cached_llm(tiny_llama_dir, cache_root, monkeypatch)
    assert caplog.text.count("loaded a step for") == n, caplog.text[-3000:]
    assert "compiled a step for" not in caplog.text, caplog.text[-3000:]
    assert _outputs(second) == reference
    assert second.engine.metrics.num_compilations == n
    assert "compiled a step for" not in caplog.text


def test_damaged_entry_is_compiled_again(tiny_llama_dir, cache_root, reference, monkeypatch,
                                         caplog):
    _cached_llm(tiny_llama_dir, cache_root, monkeypatch)  # the cache is full
    victim = sorted(cache_root.glob("*/*.jaxexe"))[0]
    victim.write_bytes(b"not an executable")
    with caplog.at_level(logging.INFO, logger="jaxinfer.runtime.runner"):
        llm = _cached_llm(tiny_llama_dir, cache_root, monkeypatch)
    assert "unusable" in caplog.text and caplog.text.count("compiled a step for") == 1
    assert victim.stat().st_size > 100  # rewritten
    assert _outputs(llm) == reference


def _warmup_inputs(llm):
    e = llm.engine
    return list(warmup_step_inputs(e.engine_config, e.max_model_len, buckets=e.buckets,
                                   bitmask_words=bitmask_words(e.vocab_size)))


class _Broken:
    """An executable as a damaged cache entry can restore it: loads, then fails when run."""

    def __init__(self):
        self.calls = 0

    def __call__(self, *args):
        self.calls += 1
        raise RuntimeError("NOT_FOUND: Function slice_bitcast-convert_fusion.3 not found")


def test_an_executable_failing_its_first_run_is_compiled_again(tiny_llama_dir, cache_root,
                                                               reference, monkeypatch, caplog):
    llm = _cached_llm(tiny_llama_dir, cache_root, monkeypatch)
    runner, inputs = llm.engine.runner, _warmup_inputs(llm)
    signature = (inputs[0].pack()[1], runner.flags)
    entries = {p: p.stat().st_mtime_ns for p in cache_root.glob("*/*.jaxexe")}
    broken = runner._executables[signature] = _Broken()
    with caplog.at_level(logging.WARNING, logger="jaxinfer.runtime.runner"):
        assert runner.check_executables(inputs) == 1
    assert broken.calls == 1 and "failed its first run" in caplog.text
    assert runner._executables[signature] is not broken
    rewritten = [p for p, t in entries.items() if p.stat().st_mtime_ns != t]
    assert len(rewritten) == 1  # its cache entry, and no other
    assert runner.check_executables(inputs) == 0  # every one runs now
    assert _outputs(llm) == reference


def test_an_executable_failing_again_after_the_recompile_raises(tiny_llama_dir, cache_root,
                                                                monkeypatch):
    llm = _cached_llm(tiny_llama_dir, cache_root, monkeypatch)
    runner, inputs = llm.engine.runner, _warmup_inputs(llm)
    signature = (inputs[-1].pack()[1], runner.flags)
    runner._executables[signature] = _Broken()
    monkeypatch.setattr(runner, "_compile_uncached", lambda step_input: _Broken())
    with pytest.raises(RuntimeError, match="not found"):
        runner.check_executables(inputs)


def test_other_settings_miss(tiny_llama_dir, cache_root, monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="jaxinfer.runtime.runner"):
        llm = _cached_llm(tiny_llama_dir, cache_root, monkeypatch, num_pages=40)
    assert "loaded a step for" not in caplog.text  # another KV pool: other shapes
    assert caplog.text.count("compiled a step for") == _num_buckets(llm)


def test_draft_model_steps_are_compiled_not_loaded():
    """The draft-model check (tests/draft_cache_check.py) in a process of its own: compiling a
    draft-model step segfaulted XLA:CPU in a process that had run many engines before (the
    whole suite), never in a fresh one."""
    check = Path(__file__).with_name("draft_cache_check.py")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(check)], cwd=check.parent.parent, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0 and "1 passed" in run.stdout, (run.stdout[-3000:]
                                                              + run.stderr[-3000:])


def test_step_key_covers_static_args_types_and_context():
    a = (jax.numpy.zeros((2, 3)), np.bool_(False))
    key = ExecutableCache.step_key(("layout",), a, "ctx")
    assert key == ExecutableCache.step_key(("layout",), (jax.numpy.ones((2, 3)), np.bool_(True)),
                                           "ctx")  # values do not matter
    assert key != ExecutableCache.step_key(("other",), a, "ctx")
    assert key != ExecutableCache.step_key(("layout",), a, "other ctx")
    assert key != ExecutableCache.step_key(("layout",), (jax.numpy.zeros((2, 4)), a[1]), "ctx")
    assert key != ExecutableCache.step_key(
        ("layout",), (jax.numpy.zeros((2, 3), jax.numpy.bfloat16), a[1]), "ctx")


def test_fingerprint_follows_the_code(monkeypatch, tmp_path):
    base = executable_cache.environment_fingerprint()
    assert base == executable_cache.environment_fingerprint()
    extra = tmp_path / "extra.py"
    extra.write_text("x = 1\n")
    files = executable_cache._source_files()
    monkeypatch.setattr(executable_cache, "_source_files", lambda: [*files, extra])
    changed = executable_cache.environment_fingerprint()
    assert changed != base
    extra.write_text("x = 2\n")
    assert executable_cache.environment_fingerprint() != changed
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    assert executable_cache.environment_fingerprint() not in (base, changed)


def test_on_with_a_cache_dir_and_jax_own_cache_off(monkeypatch, tmp_path):
    before = (jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache)
    try:
        jax.config.update("jax_enable_compilation_cache", False)
        jax.config.update("jax_compilation_cache_dir", None)
        assert ExecutableCache.from_jax_config() is None
        jax.config.update("jax_compilation_cache_dir", str(tmp_path))
        cache = ExecutableCache.from_jax_config()
        assert cache is not None and cache.root == tmp_path / executable_cache.SUBDIR
        jax.config.update("jax_enable_compilation_cache", True)  # JAX's would feed ours: off
        assert ExecutableCache.from_jax_config() is None
        jax.config.update("jax_enable_compilation_cache", False)
        monkeypatch.setenv("JAXINFER_NO_CACHE", "1")
        assert ExecutableCache.from_jax_config() is None
    finally:
        jax.config.update("jax_compilation_cache_dir", before[0])
        jax.config.update("jax_enable_compilation_cache", before[1])


_LOAD_IN_A_NEW_PROCESS = """
import logging, sys
from jaxinfer import LLM
from jaxinfer.runtime.executable_cache import ExecutableCache
ExecutableCache.from_jax_config = classmethod(lambda cls: cls(sys.argv[2]))
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
llm = LLM(sys.argv[1], warmup=True, quantization="int8", attention_backend="cpu", **eval(sys.argv[3]))
out = llm.generate([[5, 6, 7, 8]], None, use_tqdm=False)[0]
print("TOKENS", out.outputs[0].token_ids)
"""


def test_a_new_process_loads_steps_with_cpu_kernel_custom_calls(tiny_llama_dir, tmp_path):
    """A process that loads every step from the cache traces none, so it must register the C++
    kernels' handlers itself before loading (else: "No FFI handler registered", compile again)."""
    import subprocess
    import sys

    from cpu_kernels import quant_matmul

    assert quant_matmul.available(), "the CPU kernels did not build (is a C++ compiler installed?)"
    runs = []
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "-c", _LOAD_IN_A_NEW_PROCESS, tiny_llama_dir, str(tmp_path),
             repr(SETTINGS)], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(proc.stdout + proc.stderr)
    first, second = runs
    n = first.count("compiled a step for")
    assert n > 0 and "loaded a step for" not in first
    assert any("JaxinferQuantMatmul" in p.read_bytes().decode("latin-1")
               for p in tmp_path.glob("*/*.jaxexe"))  # the steps do call the quant kernel
    assert "unusable" not in second, second[-3000:]
    assert second.count("loaded a step for") == n and "compiled a step for" not in second
    assert [line for line in first.splitlines() if line.startswith("TOKENS")] == [
        line for line in second.splitlines() if line.startswith("TOKENS")]
