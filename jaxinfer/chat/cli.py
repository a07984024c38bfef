"""`jaxinfer chat`: the flags, and the backend they choose (in process, or --url).

    jaxinfer chat --model smollm2-135m
    jaxinfer chat --url http://127.0.0.1:8000 [--api-key KEY]
"""

from __future__ import annotations

import argparse
import os
import sys

from jaxinfer.chat.backends import InProcess, Remote, Sampling
from jaxinfer.chat.repl import chat_loop
from jaxinfer.config_args import add_engine_args, engine_kwargs


def add_chat_args(parser: argparse.ArgumentParser, *, default_model: str) -> None:
    parser.add_argument("--url", default=None, help="chat with a running server instead")
    parser.add_argument("--model", default=None,
                        help=f"in process: the model to load (default: {default_model}); "
                             "with --url: the model name to send (default: the server's first)")
    parser.set_defaults(chat_default_model=default_model)
    parser.add_argument("--api-key", default=None, help="with --url: default $JAXINFER_API_KEY")
    parser.add_argument("--system", default=None, help="a system prompt")
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=Sampling.max_tokens)
    g.add_argument("--temperature", type=float, default=Sampling.temperature)
    g.add_argument("--top-p", type=float, default=Sampling.top_p)
    g.add_argument("--seed", type=int, default=None, help="the requests' seed")
    add_engine_args(parser, exclude=("seed",))


def run_chat(args: argparse.Namespace) -> int:
    sampling = Sampling(max_tokens=args.max_tokens, temperature=args.temperature,
                        top_p=args.top_p, seed=args.seed)
    if args.url:
        backend = Remote(args.url, model=args.model,
                         api_key=args.api_key or os.environ.get("JAXINFER_API_KEY"))
        print(f"chatting with {backend.model} at {args.url}", file=sys.stderr)
    else:
        from jaxinfer.engine import LLMEngine

        model = args.model or args.chat_default_model
        print(f"loading {model}...", file=sys.stderr, flush=True)
        backend = InProcess(LLMEngine(model, **engine_kwargs(args)))
    return chat_loop(backend, sampling, system=args.system)
