"""Tool calling in chat: the request's `tools` and `tool_choice`, the constraint a forced call
puts on the output, and the calls read back out of the generated text.

tool_choice "none": tools are ignored. "required": the output is constrained to a JSON array of
calls, each `{"name": <one of the tools>, "arguments": <its parameters schema>}`. A named function:
the output is constrained to that function's arguments object. "auto" (the default with tools):
the chat template renders the tools (one that ignores them gets them in a system message,
`tools_system_prompt`; forced calls rely on the grammar instead), the model writes what it likes, and calls written in the
Hermes / SmolLM2 style, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (one block per
call; a block that is not such JSON stays in the content), become `message.tool_calls`; the text
outside the blocks, stripped, is the content (null when empty).
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

from jaxinfer.sampling_params import StructuredOutputs
from serve.errors import APIError

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """What a chat request does with its tools."""

    mode: str  # "none" | "auto" | "required" | "named"
    tools: tuple[dict, ...] = ()  # the validated tools (OpenAI's {"type": "function", ...})
    name: str | None = None  # mode "named": the function

    @property
    def template_tools(self) -> list[dict] | None:
        """The tools the chat template renders (None: no tools argument)."""
        return list(self.tools) if self.tools and self.mode != "none" else None

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")

    def constraint(self) -> StructuredOutputs | None:
        """The output constraint of a forced call (None otherwise)."""
        params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"}
                  for t in self.tools}
        if self.mode == "named":
            return StructuredOutputs(json=params[self.name])
        if self.mode == "required":
            calls = [{"type": "object", "properties": {"name": {"const": n}, "arguments": p},
                      "required": ["name", "arguments"], "additionalProperties": False}
                     for n, p in params.items()]
            return StructuredOutputs(json={"type": "array", "minItems": 1,
                                           "items": {"anyOf": calls}})
        return None

    def calls(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) read from a finished output: a forced call's JSON, or in "auto"
        the Hermes blocks. Text that holds no call: (text, [])."""
        if self.mode == "named":
            try:
                json.loads(text)
            except ValueError:
                return text, []
            return None, [tool_call(self.name, text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except ValueError:
                return text, []
            return None, [tool_call(c["name"], json.dumps(c["arguments"])) for c in items]
        if self.mode == "auto":
            return parse_hermes(text)
        return text, []


def tools_system_prompt(tools: list[dict]) -> str:
    """The tools described for a chat template that does not render them (SmolLM2's does not):
    the Hermes convention the "auto" parser reads back."""
    listing = "\n".join(json.dumps(t["function"]) for t in tools)
    return ("You may call one or more functions to assist with the user query. The functions "
            f"are:\n<tools>\n{listing}\n</tools>\nTo call a function, write a JSON object "
            "with its name and arguments within <tool_call></tool_call> tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def tool_call_block(name: str, arguments: str) -> str:
    """A call as the Hermes convention writes it (what `parse_hermes` reads): arguments as a
    JSON object where `arguments` (JSON text) holds one, else as the string it is."""
    try:
        args = json.loads(arguments)
    except ValueError:
        args = arguments
    return f"{TOOL_CALL_OPEN}\n{json.dumps({'name': name, 'arguments': args})}\n{TOOL_CALL_CLOSE}"


def tool_call(name: str, arguments: str) -> dict:
    """One OpenAI tool call (arguments: JSON text)."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def parse_hermes(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a `<tool_call>{...}</tool_call>` style output."""
    calls, kept = [], []
    last = 0
    for m in _HERMES_CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
            name, args = obj["name"], obj.get("arguments", obj.get("parameters", {}))
            if not isinstance(name, str):
                raise TypeError
        except (ValueError, KeyError, TypeError, AttributeError):
            continue  # not a call: it stays in the content
        kept.append(text[last:m.start()])
        last = m.end()
        calls.append(tool_call(name, args if isinstance(args, str) else json.dumps(args)))
    kept.append(text[last:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


def plan_tools(tools: list[Any] | None, tool_choice: Any) -> ToolPlan:
    """The request's ToolPlan; 400 naming `tools` or `tool_choice` for what OpenAI refuses."""
    tools = tools or []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise _bad(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", "tools")
        if not isinstance(fn.get("name"), str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}",
                                                                   fn["name"]):
            raise _bad(f"tools[{i}].function.name must be 1-64 letters, digits, _ or -", "tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise _bad(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
    names = [t["function"]["name"] for t in tools]
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise _bad(f"tool_choice={tool_choice!r} must be 'none', 'auto', 'required' or "
                       "a named function", "tool_choice")
        if tool_choice != "none" and not tools:
            raise _bad(f"tool_choice={tool_choice!r} needs tools", "tool_choice")
        return ToolPlan(tool_choice, tuple(tools))
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if tool_choice.get("type") != "function" if isinstance(tool_choice, dict) else True:
        raise _bad("tool_choice must be a string or {'type': 'function', 'function': {'name'}}",
                   "tool_choice")
    if name not in names:
        raise _bad(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
    return ToolPlan("named", tuple(tools), name)


class ToolStream:
    """Turns one choice's streamed text into chat deltas: content, or OpenAI tool-call deltas
    (`{"tool_calls": [{"index", "id", "type", "function": {"name", "arguments"}}]}` opening a call,
    then `{"tool_calls": [{"index", "function": {"arguments": chunk}}]}`). A named call streams its
    arguments as they come; "required" is held back until the choice finishes, then parsed. In
    "auto" the text streams as content, except from a `<tool_call>` (or a tail that may begin
    one) to its `</tool_call>`: a closed block that holds a call goes out as that call, any other
    as content, so the deltas add up to what the non-streamed answer says (`parse_hermes`), calls
    anywhere in the text included. Whitespace at the end of the content so far is held until text
    follows it, and dropped at the end where a call came (the non-streamed content is stripped
    around calls; whitespace before the first text is sent with it)."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.held = ""  # text not yet sent: a tag's beginning, a block, or (required) everything
        self.space = ""  # "auto": whitespace held until text follows it
        self.in_block = False  # "auto": `held` starts with <tool_call>, not yet closed
        self.passthrough = plan.mode == "none"
        self.opened = False
        self.num_calls = 0

    def feed(self, text: str, finished: bool) -> list[dict]:
        if self.passthrough:
            return [{"content": text}] if text else []
        if self.plan.mode == "named":
            out = []
            if not self.opened:
                self.opened, self.num_calls = True, 1
                call = tool_call(self.plan.name, "")
                out.append({"tool_calls": [{"index": 0, **call}]})
            if text:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            return out
        self.held += text
        if self.plan.mode == "auto":
            return self._feed_auto(finished)
        if not finished:
            return []
        content, calls = self.plan.calls(self.held)
        self.held = ""
        out = [{"content": content}] if content else []
        return out + self._call_deltas(calls)

    def _feed_auto(self, finished: bool) -> list[dict]:
        content, calls = [], []
        while True:
            if self.in_block:
                end = self.held.find(TOOL_CALL_CLOSE)
                if end < 0:
                    break
                end += len(TOOL_CALL_CLOSE)
                block, self.held, self.in_block = self.held[:end], self.held[end:], False
                _, found = parse_hermes(block)
                if found:
                    calls += found
                else:
                    content.append(block)  # not a call: it stays in the content
                continue
            start = self.held.find(TOOL_CALL_OPEN)
            if start >= 0:
                content.append(self.held[:start])
                self.held, self.in_block = self.held[start:], True
                continue
            keep = 0 if finished else _open_tag_prefix(self.held)
            content.append(self.held[:len(self.held) - keep])
            self.held = self.held[len(self.held) - keep:]
            break
        if finished:  # an unclosed block is text, as in the non-streamed answer
            content.append(self.held)
            self.held, self.in_block = "", False
        out = []
        for piece in content:
            piece = self.space + piece
            text = piece.rstrip()
            self.space = piece[len(text):]
            if text:
                out.append({"content": text})
        out += self._call_deltas(calls)
        if finished:
            if self.space and not self.num_calls:
                out.append({"content": self.space})
            self.space = ""
        return out

    def _call_deltas(self, calls: list[dict]) -> list[dict]:
        """Two deltas a call: its id, type and name, then its arguments."""
        out = []
        for call in calls:
            i = self.num_calls
            self.num_calls += 1
            out.append({"tool_calls": [{"index": i, **call, "function": {
                "name": call["function"]["name"], "arguments": ""}}]})
            out.append({"tool_calls": [{"index": i, "function": {
                "arguments": call["function"]["arguments"]}}]})
        return out


def _open_tag_prefix(text: str) -> int:
    """The length of the longest tail of `text` that begins TOOL_CALL_OPEN (0 if none)."""
    for k in range(min(len(text), len(TOOL_CALL_OPEN) - 1), 0, -1):
        if text.endswith(TOOL_CALL_OPEN[:k]):
            return k
    return 0
