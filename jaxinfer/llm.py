"""LLM: the Python API (generate / chat / stream), driving an LLMEngine."""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Iterator, Sequence

import numpy as np
from tqdm.auto import tqdm

from jaxinfer.engine.replicas import make_engine
from jaxinfer.request import RequestOutput
from jaxinfer.sampling_params import SamplingParams

Prompt = str | Sequence[int]
Message = dict[str, str]


class LLM:
    """`LLM(model="smollm2-135m")`; `model` is an HF directory, a .gguf path or a known name.

    Keyword arguments are EngineConfig fields (page_size, num_pages, max_num_seqs, dtype, ...;
    tensor_parallel_size and data_parallel_size: docs/scale_out.md).
    """

    def __init__(self, model: str, *, tokenizer: str | None = None, warmup: bool = False, **engine_kwargs):
        self.engine = make_engine(model, tokenizer=tokenizer, **engine_kwargs)  # dp > 1: replicas
        self._ids = itertools.count()
        if warmup:
            self.engine.warmup()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """`priority`: one per prompt, used with `scheduling_policy="priority"` (lower first)."""
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompts)} prompts")
        # n > 1: n child requests (seeds seed, seed+1, ... when seeded), merged into one output.
        flat_prompts, flat_params, flat_priority, owners = [], [], [], []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            for j in range(sp.n):
                child = sp if sp.n == 1 else dataclasses.replace(
                    sp, n=1, best_of=None, seed=None if sp.seed is None else sp.seed + j,
                    prompt_logprobs=sp.prompt_logprobs if j == 0 else None)  # scored once
                flat_prompts.append(p)
                flat_params.append(child)
                flat_priority.append(0 if priority is None else int(priority[i]))
                owners.append(i)
        request_ids = self._add(flat_prompts, flat_params, flat_priority)
        outs = self._run(request_ids, use_tqdm)
        merged: list[RequestOutput | None] = [None] * len(prompts)
        for i, out in zip(owners, outs):
            if merged[i] is None:
                merged[i] = out
            else:
                merged[i].outputs.extend(out.outputs)
        for m in merged:
            for j, c in enumerate(m.outputs):
                c.index = j
        return merged

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yields text deltas of one request as they are generated."""
        (request_id,) = self._add([_as_prompt(prompt)], [sampling_params or SamplingParams()])
        sent = 0
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id != request_id:
                        continue
                    text = out.outputs[0].text
                    if len(text) > sent:
                        yield text[sent:]
                        sent = len(text)
                    if out.finished:
                        return
        finally:
            self.engine.abort_request(request_id)  # no-op once it has finished

    # -- internals --------------------------------------------------------------------------
    def _add(self, prompts: list[Prompt], params: list[SamplingParams],
             priority: list[int] | None = None) -> list[str]:
        # Validate everything first, so a bad prompt does not leave half a batch queued.
        for p in prompts:
            if isinstance(p, str) and not p:
                raise ValueError("prompt must not be empty")
        request_ids = []
        try:
            for i, (prompt, sp) in enumerate(zip(prompts, params)):
                rid = f"llm-{next(self._ids)}"
                self.engine.add_request(rid, prompt, sp, priority=0 if priority is None else priority[i])
                request_ids.append(rid)
        except Exception:
            for rid in request_ids:
                self.engine.abort_request(rid)
            raise
        return request_ids

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        bar = tqdm(total=len(request_ids), desc="requests", disable=not use_tqdm, dynamic_ncols=True)
        num_tokens, t0 = 0, time.perf_counter()
        try:
            while len(final) < len(wanted):
                for out in self.engine.step():
                    if out.request_id in wanted and out.finished and out.request_id not in final:
                        final[out.request_id] = out
                        num_tokens += sum(len(c.token_ids) for c in out.outputs)
                        bar.update(1)
                        bar.set_postfix(out_tok_s=f"{num_tokens / (time.perf_counter() - t0):.1f}")
                if not self.engine.has_unfinished_requests() and len(final) < len(wanted):
                    raise RuntimeError("engine stopped with requests unfinished")
        except BaseException:
            for rid in wanted - set(final):
                self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [final[r] for r in request_ids]


def _as_prompt_list(prompts) -> list[Prompt]:
    """One prompt (a text, token ids, vLLM's {"prompt": text} or {"prompt_token_ids": ids}) or a
    sequence of them, as a list of texts and token-id sequences (checked by the engine)."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, np.ndarray) and prompts.ndim == 1):
        return [_as_prompt(prompts)]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], (int, np.integer)) and not isinstance(prompts[0], bool):
        return [prompts]  # one token-id list
    return [_as_prompt(p) for p in prompts]


def _as_prompt(prompt) -> Prompt:
    if not isinstance(prompt, dict):
        return prompt
    if set(prompt) == {"prompt"} and isinstance(prompt["prompt"], str):
        return prompt["prompt"]
    if set(prompt) == {"prompt_token_ids"}:
        return prompt["prompt_token_ids"]
    raise ValueError(f"a prompt given as a dict must be {{'prompt': text}} or "
                     f"{{'prompt_token_ids': ids}}, not one with keys {sorted(prompt)}")


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling_params for {n} prompts")
    return params
