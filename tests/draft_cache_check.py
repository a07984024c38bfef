"""The draft-model step and the executable cache, run by tests/test_executable_cache.py in a
process of its own (compiling a draft-model step segfaulted XLA:CPU in a process that had run many
engines before). The file name keeps the suite from collecting it: `pytest` runs it when named."""

from __future__ import annotations

import logging

from tests.test_executable_cache import SETTINGS, _cached_llm, _num_buckets, _outputs

# Each draft-model step compiles the target and the draft model together, one at a time: 2 tokens
# a step and one draft per sequence (with SETTINGS' 2 sequences) and a one-layer draft keep the
# buckets few (12 executables; 46 with the former 4 sequences, 8 tokens a step and 2 drafts)
# while the steps still verify drafts of two sequences at once.
SMALL = dict(max_num_batched_tokens=2)


def test_draft_model_steps_are_compiled_not_loaded(tiny_llama_dir, tmp_path, monkeypatch, caplog):
    """The draft step (target + draft model, three donated caches) never goes through the
    executable cache (loading its serialized form crashed jaxlib in a process that had run other
    engines): an engine with the cache on compiles every bucket, loads none and writes nothing,
    before and after its steps run, so no later engine can load one either."""
    from tests.tiny_models import save_tiny_model

    draft_dir = save_tiny_model("llama", tmp_path / "draft", seed=1, num_hidden_layers=1)
    spec = dict(speculative_method="draft", draft_model=draft_dir, num_speculative_tokens=1,
                spec_max_batched_tokens=16, **SMALL)
    with caplog.at_level(logging.INFO, logger="jaxinfer.runtime.runner"):
        llm = _cached_llm(tiny_llama_dir, tmp_path / "cache", monkeypatch, **spec)
    assert "loaded a step for" not in caplog.text, caplog.text[-3000:]
    n = llm.engine.metrics.num_compilations
    assert n == _num_buckets(llm) and caplog.text.count("compiled a step for") == n
    assert not list((tmp_path / "cache").rglob("*.jaxexe"))
    assert [len(tokens) for tokens, _ in _outputs(llm)] == [6, 6, 6]  # PARAMS' max_tokens
    assert not list((tmp_path / "cache").rglob("*.jaxexe"))
    assert llm.engine.metrics.num_compilations == n
