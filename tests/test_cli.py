"""The `jaxinfer` command: exit code 2 with a message on bad input; engine flags generated from
EngineConfig. `jaxinfer batch` has its own tests (tests/serve/test_batch_*.py)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Literal

import pytest

from jaxinfer.cli import build_parser, main
from jaxinfer.config import EngineConfig
from jaxinfer.config_args import add_engine_args, engine_flags, engine_kwargs


def test_generate_missing_model_exits_2(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "missing"), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "Traceback" not in err


def test_generate_bad_sampling_value_exits_2(tiny_llama_dir, capsys):
    assert main(["generate", "--model", tiny_llama_dir, "--temperature", "-1", "--prompt", "x"]) == 2
    assert "temperature" in capsys.readouterr().err


# -- engine flags ------------------------------------------------------------------------------------
def engine_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p


def test_every_engine_config_field_is_a_flag_defaulting_to_none():
    actions = {a.dest: a for a in engine_parser()._actions}
    for field in dataclasses.fields(EngineConfig):
        action = actions[field.name]
        assert "--" + field.name.replace("_", "-") in action.option_strings
        assert action.default is None and action.help, field.name
    assert engine_kwargs(engine_parser().parse_args([])) == {}


def test_engine_flags_take_type_choices_and_help_from_the_config():
    flags = {f.field: f for f in engine_flags()}
    assert flags["kv_cache_dtype"].choices == ("float32", "bfloat16", "float16", "int8")
    assert flags["kv_cache_dtype"].help == "KV cache (default: dtype); int8 is ~half of bf16"
    assert flags["quant_group_size"].type is int and flags["quant_group_size"].choices == (32, 64, 128)
    assert flags["kv_memory_fraction"].type is float  # float | None; help from the lines above
    assert flags["kv_memory_fraction"].help.startswith("Of the free device memory after the weights")
    assert flags["kv_memory_fraction"].help.endswith("since the KV pool is allocated up front)")
    assert flags["spec_min_accept_prob"].help == "the j-th draft is proposed while alpha**j >= this"
    assert "--no-prefix-caching" in flags["enable_prefix_caching"].option_strings
    kw = engine_kwargs(engine_parser().parse_args([
        "--no-prefix-caching", "--quantize-lm-head", "--quant-group-size", "64",
        "--kv-memory-fraction", "0.5", "--page-size", "32", "--speculative-method", "ngram"]))
    assert kw == {"enable_prefix_caching": False, "quantize_lm_head": True, "quant_group_size": 64,
                  "kv_memory_fraction": 0.5, "page_size": 32, "speculative_method": "ngram"}
    EngineConfig(**kw)
    assert engine_kwargs(engine_parser().parse_args(["--enable-prefix-caching"])) == {
        "enable_prefix_caching": True}
    with pytest.raises(SystemExit):
        engine_parser().parse_args(["--dtype", "int3"])


@dataclasses.dataclass(frozen=True)
class _ExtendedConfig(EngineConfig):
    # how hard to try
    #   (two lines of help)
    new_effort: Literal["low", "high"] | None = None
    new_knob: float = 0.5  # a setting added later
    new_switch: bool = False


def test_a_new_config_field_gets_its_flag_without_other_changes():
    flags = {f.field: f for f in engine_flags(_ExtendedConfig)}
    assert set(flags) == {f.name for f in dataclasses.fields(_ExtendedConfig)}
    assert flags["new_effort"].option_strings == ("--new-effort",)
    assert flags["new_effort"].choices == ("low", "high")
    assert flags["new_effort"].help == "how hard to try (two lines of help)"
    assert flags["new_knob"].type is float and flags["new_knob"].help == "a setting added later"
    assert flags["new_switch"].option_strings == ("--new-switch", "--no-new-switch")
    assert flags["page_size"].help.startswith("tokens per KV page")  # the base class's comments


def test_help_lists_the_engine_flags(capsys):
    for argv in (["--help"], ["serve", "--help"], ["generate", "--help"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert "--kv-cache-dtype" in out and "--spec-min-accept-prob" in out, argv
    main_help = build_parser().format_help()
    assert "--enable-prefix-caching" in main_help
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    serve_help = capsys.readouterr().out
    assert "--no-prefix-caching" in serve_help and "--api-key" in serve_help
    assert "reuse the KV pages of prompts seen before" in serve_help


def test_generate_keeps_its_sampling_seed():
    args = build_parser().parse_args(["generate", "--seed", "7", "--page-size", "32"])
    assert args.seed == 7 and engine_kwargs(args) == {"page_size": 32}


def test_the_compilation_cache_follows_the_cache_root(monkeypatch, tmp_path):
    from serve.cli import default_compilation_cache_dir

    monkeypatch.setenv("JAXINFER_CACHE_DIR", str(tmp_path / "root"))
    assert default_compilation_cache_dir() == str(tmp_path / "root" / "jax")
    monkeypatch.delenv("JAXINFER_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_compilation_cache_dir() == str(tmp_path / "xdg" / "jaxinfer" / "jax")
