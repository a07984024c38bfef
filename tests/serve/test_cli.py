"""serve/cli.py: flags, TOML presets, the compilation cache settings, names."""

from __future__ import annotations

import argparse

import pytest

from jaxinfer import disk_cache
from serve import cli


def parse(*argv):
    p = argparse.ArgumentParser()
    cli.add_serve_args(p)
    return p.parse_args(list(argv))


def test_defaults_bind_loopback_only():
    args = parse()
    assert args.host == "127.0.0.1" and args.port == 8000 and args.model == cli.DEFAULT_MODEL
    assert args.api_key is None and not args.no_compilation_cache
    assert args.compilation_cache_dir == str(disk_cache.cache_root() / "jax")


def test_api_key_from_flag_or_env(monkeypatch):
    monkeypatch.delenv(cli.API_KEY_ENV, raising=False)
    assert cli.resolve_api_key(parse()) is None
    monkeypatch.setenv(cli.API_KEY_ENV, "from-env")
    assert cli.resolve_api_key(parse()) == "from-env"
    assert cli.resolve_api_key(parse("--api-key", "flag")) == "flag"


def test_preset_then_flags(tmp_path):
    preset = tmp_path / "p.toml"
    preset.write_text("[engine]\npage_size = 32\nmax_num_seqs = 4\nenable_prefix_caching = false\n")
    settings = cli.engine_settings(parse("--config", str(preset), "--max-num-seqs", "8"))
    assert settings == {"page_size": 32, "max_num_seqs": 8, "enable_prefix_caching": False}
    top_level = tmp_path / "q.toml"
    top_level.write_text("max_model_len = 512\n")
    assert cli.engine_settings(parse("--config", str(top_level))) == {"max_model_len": 512}
    # an explicit flag equal to the EngineConfig default still overrides the preset
    assert cli.engine_settings(parse("--config", str(preset), "--page-size", "16"))["page_size"] == 16


def test_preset_errors_name_the_problem(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("page_sise = 32\n")
    with pytest.raises(ValueError, match="page_sise"):
        cli.engine_settings(parse("--config", str(bad)))
    broken = tmp_path / "broken.toml"
    broken.write_text("page_size = [\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        cli.engine_settings(parse("--config", str(broken)))
    with pytest.raises(ValueError, match="No such file"):
        cli.engine_settings(parse("--config", str(tmp_path / "missing.toml")))


def test_compilation_cache_settings(tmp_path):
    import jax

    from jaxinfer.runtime.executable_cache import SUBDIR, ExecutableCache

    names = ("jax_compilation_cache_dir", "jax_enable_compilation_cache")
    before = {n: getattr(jax.config, n) for n in names}
    try:
        cli.enable_compilation_cache(str(tmp_path / "cache"))
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "cache")
        assert (tmp_path / "cache").is_dir()
        assert jax.config.jax_enable_compilation_cache is False  # JAX's own cache: off
        assert ExecutableCache.from_jax_config().root == tmp_path / "cache" / SUBDIR  # ours: on
    finally:
        for n, v in before.items():
            jax.config.update(n, v)


def test_served_name(tmp_path):
    assert cli.served_name("smollm2-135m") == "smollm2-135m"
    d = tmp_path / "My-Model"
    d.mkdir()
    assert cli.served_name(str(d) + "/") == "My-Model"
    f = tmp_path / "m.Q4.gguf"
    f.write_bytes(b"")
    assert cli.served_name(str(f)) == "m.Q4"


def test_loopback_detection():
    assert cli._is_loopback("127.0.0.1") and cli._is_loopback("::1")
    assert cli._is_loopback("localhost")
    assert not cli._is_loopback("0.0.0.0") and not cli._is_loopback("10.1.2.3")


def test_jaxinfer_cli_wires_serve():
    from jaxinfer.cli import build_parser

    args = build_parser().parse_args(["serve", "some-model", "--port", "9001", "--api-key", "k"])
    assert args.model == "some-model" and args.port == 9001 and args.api_key == "k"
    assert args.func.__name__ == "cmd_serve"
