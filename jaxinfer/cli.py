"""The `jaxinfer` command: generate, chat, serve, batch, bench, quantize, eval-ppl.

The engine flags of every subcommand are generated from EngineConfig (jaxinfer/config_args.py);
`serve` and `batch` are the server package's own entry points (serve/cli.py, serve/batch_cli.py).

Logging (serve/logs.py): `serve` logs at INFO (start-up, warm-up, ready, a line per request);
`generate` and `batch` print only their results and errors unless -v, which shows the same
start-up lines on stderr; --log-level (before the command, or after `serve`) sets the level.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
import time

from jaxinfer.bench.cli import add_bench_args, run_bench
from jaxinfer.chat.cli import add_chat_args, run_chat
from jaxinfer.config import EngineConfig
from jaxinfer.config_args import add_engine_args, engine_flags, engine_kwargs
from jaxinfer.llm import LLM
from jaxinfer.models.loader import quantize_checkpoint
from jaxinfer.models.perplexity import eval_ppl
from jaxinfer.sampling_params import SamplingParams
from serve.batch_cli import add_batch_args, run_batch_command
from serve.cli import DEFAULT_MODEL, add_serve_args, run_serve
from serve.logs import LEVELS, configure_logging, log_level_arg

# `generate` prints whole answers to a person: the API's default (DEFAULT_MAX_TOKENS, 16) would
# cut most of them off mid-sentence.
GENERATE_MAX_TOKENS = 128


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=GENERATE_MAX_TOKENS)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None, help="the requests' seed")
    g.add_argument("--stop", action="append", default=None)


def cmd_generate(args: argparse.Namespace) -> int:
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop,
    )
    llm = LLM(args.model, **engine_kwargs(args))
    prompts = args.prompt or ["Hello, my name is"]
    if args.chat:
        for prompt in prompts:
            for piece in llm.stream(llm.tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}], add_generation_prompt=True), params):
                print(piece, end="", flush=True)
            print()
    else:
        for out in llm.generate(prompts, params, use_tqdm=False):
            print(out.prompt + out.outputs[0].text if out.prompt else out.outputs[0].text)
    return 0


def cmd_batch(args: argparse.Namespace) -> int:
    return run_batch_command(args)


def cmd_quantize(args: argparse.Namespace) -> int:
    if args.quantization not in ("int8", "int4"):
        raise ValueError("quantize needs --quantization int8 or int4")
    t0 = time.perf_counter()
    out = quantize_checkpoint(args.model, args.out, EngineConfig(**engine_kwargs(args)))
    print(f"saved {out} in {time.perf_counter() - t0:.1f} s")
    return 0


def cmd_eval_ppl(args: argparse.Namespace) -> int:
    if not os.path.isfile(args.text):
        raise ValueError(f"--text {args.text!r} does not exist")
    ppl, n = eval_ppl(args.model, args.text, EngineConfig(**engine_kwargs(args)), chunk=args.chunk)
    print(f"perplexity {ppl:.4f} over {n} tokens")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    return run_serve(args)


def build_parser() -> argparse.ArgumentParser:
    engine_options = ", ".join(f.option_strings[0] for f in engine_flags())
    epilog = textwrap.fill(f"Every command takes the engine flags (EngineConfig fields): "
                           f"{engine_options}. `jaxinfer COMMAND --help` explains them.",
                           width=100, break_on_hyphens=False)
    parser = argparse.ArgumentParser(prog="jaxinfer", description="LLM inference on JAX/XLA",
                                     epilog=epilog,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-level", type=log_level_arg, choices=LEVELS, default=None,
                        help="default: INFO for serve (and with -v), WARNING otherwise")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate text for prompts")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--prompt", action="append", help="may be given several times")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    _add_verbose(p)
    # --seed here is the requests' seed (sampling), which is what EngineConfig.seed stands in for
    add_engine_args(p, exclude=("seed",))
    add_sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("batch", help="run a JSONL file of requests (OpenAI batch lines or {prompt|messages, ...})")
    add_batch_args(p)
    _add_verbose(p)
    p.set_defaults(func=cmd_batch)

    p = sub.add_parser("quantize", help="save a pre-quantized checkpoint (orbax) that loads fast")
    p.add_argument("model")
    p.add_argument("--out", required=True)
    add_engine_args(p)
    p.set_defaults(func=cmd_quantize)

    p = sub.add_parser("eval-ppl", help="perplexity of a model over a text file")
    p.add_argument("model")
    p.add_argument("--text", required=True)
    p.add_argument("--chunk", type=int, default=512, help="tokens per window")
    add_engine_args(p)
    p.set_defaults(func=cmd_eval_ppl)

    p = sub.add_parser("bench", help="throughput and latency on a synthetic workload: the "
                                     "engine in process, or a server (--url)")
    add_bench_args(p, default_model=DEFAULT_MODEL)
    p.set_defaults(func=run_bench)

    p = sub.add_parser("chat", help="interactive streaming chat in the terminal: the engine in "
                                    "process, or a server (--url)")
    add_chat_args(p, default_model=DEFAULT_MODEL)
    p.set_defaults(func=run_chat)

    p = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    add_serve_args(p)
    p.set_defaults(func=cmd_serve)
    return parser


def _add_verbose(p: argparse.ArgumentParser) -> None:
    p.add_argument("-v", "--verbose", action="store_true",
                   help="log the start-up (model, KV pool, warm-up) on stderr")


def log_level(args: argparse.Namespace) -> str:
    """--log-level if given, else INFO for serve and with -v, else WARNING (serve/logs.py)."""
    if args.log_level is not None:
        return args.log_level
    return "INFO" if args.command == "serve" or getattr(args, "verbose", False) else "WARNING"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(log_level(args))
    try:
        return args.func(args)
    except ValueError as e:
        print(f"jaxinfer: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
