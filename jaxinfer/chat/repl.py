"""The chat loop: read a line, stream the answer, keep the conversation.

    /reset   forget the conversation (the system prompt stays)
    /exit    quit (so do Ctrl-D and /quit)

After each answer one line tells its tokens and tokens/s (from the first token to the last, so
the prompt's time is not counted; with the time to the first token beside it). Ctrl-C stops an
answer; what was said stays out of the history.
"""

from __future__ import annotations

import sys
import time

from jaxinfer.chat.backends import Message, Sampling

PROMPT = ">>> "
HELP = "type a message; /reset forgets the conversation, /exit quits"


def chat_loop(backend, sampling: Sampling, *, system: str | None = None,
              read=input, out=sys.stdout) -> int:
    try:
        import readline  # noqa: F401 - line editing and history for input(), where available
    except ImportError:
        pass
    base: list[Message] = [{"role": "system", "content": system}] if system else []
    history = list(base)
    print(HELP, file=out, flush=True)
    while True:
        try:
            line = read(PROMPT)
        except EOFError:
            print(file=out)
            return 0
        except KeyboardInterrupt:
            print(file=out)
            continue
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            history = list(base)
            print("(conversation cleared)", file=out, flush=True)
            continue
        if text.startswith("/"):
            print(f"unknown command {text}; {HELP}", file=out, flush=True)
            continue
        messages = [*history, {"role": "user", "content": text}]
        answer, t0, first = [], time.perf_counter(), None
        try:
            for piece in backend.stream(messages, sampling):
                if first is None:
                    first = time.perf_counter()
                answer.append(piece)
                out.write(piece)
                out.flush()
        except KeyboardInterrupt:
            print("\n(interrupted)", file=out, flush=True)
            continue
        except Exception as e:  # noqa: BLE001 - one failed answer does not end the chat
            print(f"\nerror: {e}", file=out, flush=True)
            continue
        end = time.perf_counter()
        history = [*messages, {"role": "assistant", "content": "".join(answer)}]
        print(file=out)
        print(stats_line(backend.tokens, t0, first, end), file=out, flush=True)


def stats_line(tokens: int, t0: float, first: float | None, end: float) -> str:
    first = first if first is not None else end
    decode = end - first
    rate = (tokens - 1) / decode if tokens > 1 and decode > 0 else tokens / max(end - t0, 1e-9)
    return f"[{tokens} tokens, {rate:.1f} tok/s, first token {1000 * (first - t0):.0f} ms]"
