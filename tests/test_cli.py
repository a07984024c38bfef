"""The `jaxinfer` command: exit code 2 with a message on bad input; engine flags generated from
EngineConfig; batch jobs over JSONL."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Literal

import pytest

from jaxinfer.cli import build_parser, main
from jaxinfer.config import EngineConfig
from jaxinfer.config_args import add_engine_args, engine_flags, engine_kwargs
from serve.batch import run_batch_with


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


def test_batch_missing_input_exits_2(tmp_path, capsys):
    assert main(["batch", str(tmp_path / "nope.jsonl"), str(tmp_path / "out.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_batch_job_mixed_lines(tiny_llm, tmp_path):
    """OpenAI batch lines get OpenAI batch output lines (the server's own response bodies: n,
    logprobs, echo, 4xx answers); plain lines get {custom_id, text, finish_reason, usage}; bad
    lines fail alone, in input order."""
    from jaxinfer import SamplingParams

    greedy = dict(temperature=0, ignore_eos=True)
    lines = [
        {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Hello"}],
                  "max_tokens": 4, "n": 2, "logprobs": True, "top_logprobs": 1, **greedy}},
        {"id": "b", "prompt": "The quick brown fox", "max_tokens": 3, **greedy},
        {"id": "c", "prompt": "bad", "temperature": -2},
        "not an object",
        {"custom_id": "e", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "The quick brown fox", "max_tokens": 3, "echo": True, "logprobs": 0,
                  "stream": True, **greedy}},
        {"custom_id": "f", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "x", "max_tokens": 0}},
        {"custom_id": "g", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
    ]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    out = tmp_path / "out.jsonl"
    assert run_batch_with(tiny_llm.engine, str(inp), str(out), use_tqdm=False) == 1  # some lines failed
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["custom_id"] for r in rows] == ["a", "b", "c", "3", "e", "f", "g"]
    expected = tiny_llm.generate(["The quick brown fox"], SamplingParams(max_tokens=3, **greedy),
                                 use_tqdm=False)[0]
    text = expected.outputs[0].text

    a = rows[0]
    assert a["error"] is None and a["response"]["status_code"] == 200
    body = a["response"]["body"]
    assert body["object"] == "chat.completion" and a["response"]["request_id"] == body["id"]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][0]["message"]["content"] == body["choices"][1]["message"]["content"]
    assert len(body["choices"][0]["logprobs"]["content"]) == 4
    assert body["usage"]["completion_tokens"] == 8

    assert rows[1] == {"custom_id": "b", "text": text, "finish_reason": "length",
                       "usage": {"prompt_tokens": len(expected.prompt_token_ids),
                                 "completion_tokens": 3}}
    assert "temperature" in rows[2]["error"]["message"] and rows[2]["error"]["line"] == 3
    assert "error" in rows[3]

    e = rows[4]["response"]["body"]["choices"][0]
    assert e["text"] == "The quick brown fox" + text
    n = len(expected.prompt_token_ids)
    assert len(e["logprobs"]["token_logprobs"]) == n + 3 and e["logprobs"]["token_logprobs"][0] is None
    assert rows[5]["response"]["status_code"] == 400
    assert rows[5]["response"]["body"]["error"]["param"] == "max_tokens"
    assert rows[6]["response"] is None and "url" in rows[6]["error"]["message"]
    assert not tiny_llm.engine.has_unfinished_requests()
    assert tiny_llm.engine.scheduler.pool.num_free_pages == tiny_llm.engine.num_pages - 1