"""The `jaxinfer` command: generate, serve, batch (and the quantization tools)."""

from __future__ import annotations

import argparse
import logging
import sys

DEFAULT_MODEL = "smollm2-135m"


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--page-size", type=int, default=None)
    g.add_argument("--num-pages", type=int, default=None, help="KV pages (default: from --kv-memory-fraction)")
    g.add_argument("--kv-memory-fraction", type=float, default=None)
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    g.add_argument("--kv-cache-dtype", default=None, choices=["float32", "bfloat16", "float16", "int8"],
                   help="KV cache dtype (default: --dtype); int8 halves KV memory vs bfloat16")
    g.add_argument("--attention-backend", default=None, choices=["auto", "xla", "pallas"])
    g.add_argument("--quantization", default=None, choices=["int8", "int4"])
    g.add_argument("--quant-group-size", type=int, default=None, choices=[32, 64, 128],
                   help="int4 group size (default 32)")
    g.add_argument("--quantize-lm-head", action="store_true", default=None,
                   help="also quantize the LM head / tied embeddings (in the same format: int8, or "
                        "int4 with GPTQ for the head)")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--speculative-method", default=None, choices=["ngram", "draft"])
    g.add_argument("--num-speculative-tokens", type=int, default=None)
    g.add_argument("--draft-model", default=None, help="draft model path (speculative 'draft')")
    g.add_argument("--scheduling", default=None, choices=["continuous", "static"])
    g.add_argument("--scheduling-policy", default=None, choices=["fcfs", "priority"],
                   help="priority: requests with a lower `priority` run first and may preempt")
    g.add_argument("--load-format", default=None, choices=["auto", "dummy"])


def engine_kwargs(args: argparse.Namespace) -> dict:
    keys = ["page_size", "num_pages", "kv_memory_fraction", "max_num_seqs", "max_num_batched_tokens",
            "max_model_len", "dtype", "kv_cache_dtype", "attention_backend", "quantization",
            "quant_group_size", "quantize_lm_head", "scheduling", "scheduling_policy", "load_format",
            "speculative_method", "num_speculative_tokens", "draft_model"]
    kw = {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}
    if getattr(args, "no_prefix_caching", False):
        kw["enable_prefix_caching"] = False
    return kw


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None)


def cmd_generate(args: argparse.Namespace) -> int:
    from jaxinfer import LLM, SamplingParams

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
    from jaxinfer.batch import run_batch

    return run_batch(args.input, args.output, args.model, engine_kwargs(args))


def cmd_quantize(args: argparse.Namespace) -> int:
    import time

    from jaxinfer.config import EngineConfig
    from jaxinfer.models.loader import quantize_checkpoint

    if args.quantization is None:
        raise ValueError("quantize needs --quantization int8 or int4")
    t0 = time.perf_counter()
    out = quantize_checkpoint(args.model, args.out, EngineConfig(**engine_kwargs(args)))
    print(f"saved {out} in {time.perf_counter() - t0:.1f} s")
    return 0


def cmd_eval_ppl(args: argparse.Namespace) -> int:
    import os

    from jaxinfer.config import EngineConfig
    from jaxinfer.models.perplexity import eval_ppl

    if not os.path.isfile(args.text):
        raise ValueError(f"--text {args.text!r} does not exist")
    ppl, n = eval_ppl(args.model, args.text, EngineConfig(**engine_kwargs(args)), chunk=args.chunk)
    print(f"perplexity {ppl:.4f} over {n} tokens")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from serve.cli import run_serve

    return run_serve(args) or 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxinfer", description="LLM inference on JAX/XLA")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate text for prompts")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--prompt", action="append", help="may be given several times")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("batch", help="run a JSONL file of requests (OpenAI batch lines or {prompt|messages, ...})")
    p.add_argument("input")
    p.add_argument("output")
    p.add_argument("--model", default=DEFAULT_MODEL)
    add_engine_args(p)
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

    p = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    try:
        from serve.cli import add_serve_args
    except ImportError:  # the server package is optional for the other commands
        add_serve_args = None
    if add_serve_args is not None:
        add_serve_args(p)
    else:
        p.add_argument("model", nargs="?", default=DEFAULT_MODEL)
        add_engine_args(p)
    p.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as e:
        print(f"jaxinfer: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
