"""The `jaxinfer` command: exit code 2 with a message on bad input; batch jobs over JSONL."""

from __future__ import annotations

import json

from jaxinfer.cli import main
from serve.batch import run_batch_with


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