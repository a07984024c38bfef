"""The prompts of a request as token ids: chat messages through the model's chat template, and
completion prompts in the API's four forms (a text, texts, token ids, lists of token ids).

Tokenizing runs on a worker thread (`asyncio.to_thread`), off the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Sequence

from jaxinfer.tokenizer import Tokenizer
from serve.errors import APIError
from serve.schemas import CompletionPrompt, Message
from serve.tools import tool_call_block, tools_system_prompt


@dataclasses.dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    text: str | None  # what `echo` sends back; None when the client sent token ids or messages


def check_token_ids(token_ids: Sequence[int], vocab_size: int, param: str) -> None:
    """APIError (400 naming `param`) for ids outside [0, vocab_size)."""
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise APIError(400, f"{param} holds token ids outside the vocabulary [0, {vocab_size}): "
                            f"{bad[:5]}", param=param, code="invalid_value")


async def chat_prompt(tokenizer: Tokenizer, messages: list[Message],
                      add_generation_prompt: bool, tools: list[dict] | None = None,
                      describe_tools: bool = False) -> Prompt:
    """The token ids of `messages` (and `tools`, when given) rendered by the chat template; a
    template that refuses them (or has no chat template) is a 400 on `messages`. With
    `describe_tools`, a template that ignores the tools gets them in a system message."""
    conversation = [m.template_message() for m in messages]
    extra = {"tools": tools} if tools else {}
    try:
        if any(m.get("tool_calls") for m in conversation):
            conversation = await asyncio.to_thread(_with_calls_as_text, tokenizer, conversation,
                                                   add_generation_prompt)
        if tools and describe_tools:
            conversation = await asyncio.to_thread(_with_tools, tokenizer, conversation, tools,
                                                   add_generation_prompt)
        token_ids = await asyncio.to_thread(tokenizer.apply_chat_template, conversation,
                                            add_generation_prompt=add_generation_prompt, **extra)
    except (ValueError, TypeError, KeyError) as e:
        raise APIError(400, f"the chat template failed on these messages: {e}",
                       param="messages", code="invalid_value") from None
    except Exception as e:  # jinja2 TemplateError (raise_exception in the template) and kin
        if type(e).__module__.startswith("jinja2"):
            raise APIError(400, f"the chat template refused these messages: {e}",
                           param="messages", code="invalid_value") from None
        raise
    return Prompt(list(token_ids), None)


def _with_tools(tokenizer: Tokenizer, conversation: list[dict], tools: list[dict],
                add_generation_prompt: bool) -> list[dict]:
    """The conversation as rendered with tools: unchanged when the chat template renders `tools`,
    else with the tools described in a system message (Hermes style, serve/tools.py), appended to
    the conversation's own system message if it has one."""
    with_tools = tokenizer.render_chat_template(conversation, add_generation_prompt, tools=tools)
    if with_tools != tokenizer.render_chat_template(conversation, add_generation_prompt):
        return conversation
    text = tools_system_prompt(tools)
    if conversation and conversation[0].get("role") == "system":
        first = conversation[0]
        return [{**first, "content": f"{first.get('content') or ''}\n\n{text}"}] + conversation[1:]
    return [{"role": "system", "content": text}] + conversation


def _with_calls_as_text(tokenizer: Tokenizer, conversation: list[dict],
                        add_generation_prompt: bool) -> list[dict]:
    """The conversation unchanged when the chat template renders the assistant messages'
    `tool_calls`; else (SmolLM2's renders such a turn empty) with each call written into its
    message's content as the Hermes block the model writes a call as (serve/tools.py), so that
    in a multi-turn tool use the model sees the calls it made before the tools' answers."""
    bare = [{k: v for k, v in m.items() if k != "tool_calls"} for m in conversation]
    if (tokenizer.render_chat_template(conversation, add_generation_prompt)
            != tokenizer.render_chat_template(bare, add_generation_prompt)):
        return conversation
    return [_calls_as_text(m) if m.get("tool_calls") else m for m in conversation]


def _calls_as_text(message: dict) -> dict:
    """An assistant message whose tool calls are appended to its content as Hermes blocks."""
    blocks = [tool_call_block(c["function"]["name"], c["function"]["arguments"])
              for c in message["tool_calls"]]
    text = "\n".join(part for part in [message.get("content") or ""] + blocks if part)
    return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": text}


async def completion_prompts(tokenizer: Tokenizer, prompt: CompletionPrompt,
                             vocab_size: int) -> list[Prompt]:
    """One Prompt per prompt of a completions request (validated by the schema already)."""
    if isinstance(prompt, str):
        texts = [prompt]
    elif prompt and isinstance(prompt[0], str):
        texts = list(prompt)
    elif prompt and isinstance(prompt[0], int):
        check_token_ids(prompt, vocab_size, "prompt")
        return [Prompt(list(prompt), None)]
    else:
        for ids in prompt:
            check_token_ids(ids, vocab_size, "prompt")
        return [Prompt(list(ids), None) for ids in prompt]
    ids_list = await asyncio.to_thread(lambda: [tokenizer.encode(t) for t in texts])
    for text, ids in zip(texts, ids_list):
        if not ids:
            raise APIError(400, f"prompt {text!r} encodes to no tokens", param="prompt",
                           code="invalid_value")
    return [Prompt(list(ids), text) for ids, text in zip(ids_list, texts)]
