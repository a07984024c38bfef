"""Batch jobs over JSONL files.

Each input line is either an OpenAI batch line
  {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [...], ...}}
or a plain request {"id"?: ..., "prompt" | "messages": ..., "max_tokens"?: ..., "temperature"?: ...}.
Each output line carries the id, the generated text, token counts and finish reason, or an error for
that line alone (a bad line never stops the job).
"""

from __future__ import annotations

import json
import os
import sys

from jaxinfer.sampling_params import SamplingParams

_PARAM_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
               "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
               "ignore_eos", "stop_token_ids")


def parse_line(line: str, index: int) -> tuple[str, dict, str]:
    """Returns (custom_id, body, kind) where kind is "chat" or "completion"."""
    obj = json.loads(line)
    if not isinstance(obj, dict):
        raise ValueError("a line must be a JSON object")
    if "body" in obj:
        custom_id = str(obj.get("custom_id", index))
        body = obj["body"]
        kind = "chat" if "chat" in obj.get("url", "/v1/chat/completions") else "completion"
    else:
        custom_id = str(obj.get("id", obj.get("custom_id", index)))
        body = obj
        kind = "chat" if "messages" in obj else "completion"
    if kind == "chat" and "messages" not in body:
        raise ValueError("a chat line needs 'messages'")
    if kind == "completion" and "prompt" not in body:
        raise ValueError("a completion line needs 'prompt'")
    return custom_id, body, kind


def sampling_params_from_body(body: dict) -> SamplingParams:
    kw = {k: body[k] for k in _PARAM_KEYS if k in body and body[k] is not None}
    if "max_completion_tokens" in body and body["max_completion_tokens"] is not None:
        kw["max_tokens"] = body["max_completion_tokens"]
    return SamplingParams(**kw)


def run_batch(input_path: str, output_path: str, model: str, engine_kwargs: dict) -> int:
    from jaxinfer.llm import LLM

    if not os.path.isfile(input_path):
        raise ValueError(f"input file {input_path!r} does not exist")
    return run_batch_with(LLM(model, **engine_kwargs), input_path, output_path)


def run_batch_with(llm, input_path: str, output_path: str, *, use_tqdm: bool = True) -> int:
    """Runs every line through one continuous batch; returns 0, or 1 when some line failed."""
    with open(input_path) as f:
        lines = [ln for ln in f if ln.strip()]
    engine = llm.engine
    results: dict[int, dict] = {}
    rid_to_line: dict[str, tuple[int, str]] = {}
    for i, line in enumerate(lines):
        custom_id = str(i)
        try:
            custom_id, body, kind = parse_line(line, i)
            params = sampling_params_from_body(body)
            prompt = (llm.tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True)
                      if kind == "chat" else body["prompt"])
            rid = f"batch-{i}"
            engine.add_request(rid, prompt, params)
            rid_to_line[rid] = (i, custom_id)
        except (ValueError, TypeError, KeyError, json.JSONDecodeError) as e:
            results[i] = {"custom_id": custom_id, "error": {"message": str(e), "line": i + 1}}
    from tqdm.auto import tqdm

    with tqdm(total=len(rid_to_line), desc="batch", disable=not use_tqdm) as bar:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished and out.request_id in rid_to_line:
                    i, custom_id = rid_to_line[out.request_id]
                    c = out.outputs[0]
                    results[i] = {
                        "custom_id": custom_id,
                        "text": c.text,
                        "finish_reason": c.finish_reason,
                        "usage": {"prompt_tokens": len(out.prompt_token_ids),
                                  "completion_tokens": len(c.token_ids)},
                    }
                    bar.update(1)
    with open(output_path, "w") as f:
        for i in range(len(lines)):
            f.write(json.dumps(results[i]) + "\n")
    num_errors = sum("error" in r for r in results.values())
    print(f"{len(lines) - num_errors} done, {num_errors} failed -> {output_path}", file=sys.stderr)
    return 0 if num_errors == 0 else 1
