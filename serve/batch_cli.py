"""`jaxinfer batch IN OUT`: the command's flags and what it runs (serve/batch.py runs the job).

The engine is built only when some line of IN is not answered in OUT yet, with the JAX persistent
compilation cache on as for `jaxinfer serve` (serve/cli.py), so a rerun after a kill does not
compile again.
"""

from __future__ import annotations

import argparse

from jaxinfer.config_args import add_engine_args, engine_kwargs
from jaxinfer.engine import EngineClient
from jaxinfer.engine.replicas import make_engine as make_engine_client
from serve.batch import BatchOptions, run_batch
from serve.cli import DEFAULT_MODEL, default_compilation_cache_dir, enable_compilation_cache


def add_batch_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", help="JSONL requests: OpenAI batch lines or {prompt|messages, ...}")
    parser.add_argument("output", help="JSONL answers, appended in completion order; rerun the "
                                       "same command to finish a job that was stopped")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    g = parser.add_argument_group("batch")
    g.add_argument("--max-in-flight", type=int, default=BatchOptions.max_in_flight,
                   help="lines posted at once (default: %(default)s)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    g.add_argument("--compilation-cache-dir", default=default_compilation_cache_dir(),
                   help="JAX persistent compilation cache and jaxinfer's compiled steps "
                        "(default: %(default)s)")
    g.add_argument("--no-compilation-cache", action="store_true",
                   help="do not read or write the compilation caches")
    add_engine_args(parser)


def run_batch_command(args: argparse.Namespace) -> int:
    """The job's exit status: 0 every line answered without error, 1 some errors; ValueError on
    bad usage (the caller exits 2)."""

    def make_engine() -> EngineClient:
        if not args.no_compilation_cache:
            enable_compilation_cache(args.compilation_cache_dir)
        return make_engine_client(args.model, **engine_kwargs(args))  # dp > 1: replicas

    options = BatchOptions(max_in_flight=args.max_in_flight, progress=not args.no_progress)
    return run_batch(args.input, args.output, make_engine, options)
