"""The `jaxinfer` command: exit code 2 with a message on bad input; batch jobs over JSONL."""

from __future__ import annotations

import json

from jaxinfer.batch import run_batch_with
from jaxinfer.cli import main


def test_generate_missing_model_exits_2(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "missing"), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "Traceback" not in err


def test_generate_bad_sampling_value_exits_2(tiny_llama_dir, capsys):
    assert main(["generate", "--model", tiny_llama_dir, "--temperature", "-1", "--prompt", "x"]) == 2
    assert "temperature" in capsys.readouterr().err


def test_batch_missing_input_exits_2(tmp_path, capsys):
    assert main(["batch", str(tmp_path / "nope.jsonl"), str(tmp_path / "out.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_batch_job_mixed_lines(tiny_llm, tmp_path):
    lines = [
        {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4,
                  "temperature": 0, "ignore_eos": True}},
        {"id": "b", "prompt": "The quick brown fox", "max_tokens": 3, "temperature": 0,
         "ignore_eos": True},
        {"id": "c", "prompt": "bad", "temperature": -2},
        "not an object",
    ]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    out = tmp_path / "out.jsonl"
    assert run_batch_with(tiny_llm, str(inp), str(out), use_tqdm=False) == 1  # some lines failed
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["custom_id"] for r in rows] == ["a", "b", "c", "3"]
    assert rows[0]["usage"]["completion_tokens"] == 4 and rows[0]["finish_reason"] == "length"
    assert rows[1]["usage"]["completion_tokens"] == 3
    expected = tiny_llm.generate(["The quick brown fox"], __import__("jaxinfer").SamplingParams(
        max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    assert rows[1]["text"] == expected
    assert "temperature" in rows[2]["error"]["message"]
    assert "error" in rows[3]
    assert not tiny_llm.engine.has_unfinished_requests()
