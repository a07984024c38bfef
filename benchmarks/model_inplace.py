"""Is the KV cache updated in place? Time the model's paged step at two pool sizes.

    JAX_PLATFORMS=cpu python benchmarks/model_inplace.py [--model smollm2-135m] [--batch 1 32]
        [--pages 1024 8192] [--context 256] [--backend xla]

Random weights of the model's shapes (load_format="dummy"), the runtime's jit pattern (nnx.split
once, a plain jitted function that merges inside, the cache donated). A step whose time grows with
the pool size copies the cache; an in-place step costs the same at both sizes. Prints a table of
compile seconds (lower + compile), median step milliseconds (decode: one token per sequence,
`--context` tokens of context each) and the number of ops in the optimized HLO that produce a
whole cache-shaped array other than the in-place write (dynamic-update-slice / scatter): a copy
would show up there. The pool sizes are timed alternately, step by step, so load on a shared
machine hits both alike.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--pages", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--backend", default="xla")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxinfer.config import EngineConfig
    from jaxinfer.models.loader import load_model
    from jaxinfer.ops.kv_cache import AttentionMetadata, allocate_kv_cache

    config, model = load_model(args.model, EngineConfig(load_format="dummy", dtype=args.dtype))
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(state, kv_cache, input_ids, positions, md, rows):
        model = nnx.merge(graphdef, state)
        hidden, kv_cache = model(input_ids, positions, kv_cache, md, attention_backend=args.backend)
        return jnp.argmax(model.compute_logits(hidden[rows]), axis=-1), kv_cache

    ps = args.page_size
    pages_per_seq = -(-(args.context + args.iters + 2) // ps)
    print(f"model={args.model} backend={args.backend} dtype={args.dtype} context={args.context} "
          f"platform={jax.default_backend()} (pool sizes timed alternately, step by step)")
    print(f"{'batch':>6} {'pages':>6} {'cache MB':>9} {'compile s':>10} {'step ms':>8} "
          f"{'cache-sized ops':>16}")
    for batch in args.batch:
        runs = {}
        for num_pages in args.pages:
            if batch * pages_per_seq + 1 > num_pages:
                print(f"{batch:>6} {num_pages:>6}  (pool too small)")
                continue
            rng = np.random.default_rng(0)
            # sequences hold scattered pages spread over the whole pool
            page_ids = rng.choice(np.arange(1, num_pages), batch * pages_per_seq, replace=False)
            runs[num_pages] = dict(
                cache=allocate_kv_cache(config, num_pages, ps, jnp.dtype(args.dtype)),
                page_indices=page_ids.reshape(batch, pages_per_seq).astype(np.int32), times=[])

        def inputs(run, it):
            pos = args.context + it
            page_indices = run["page_indices"]
            slots = page_indices[:, pos // ps] * ps + pos % ps
            md = AttentionMetadata(
                slot_mapping=jnp.asarray(slots, jnp.int32),
                cu_q_lens=jnp.arange(batch + 1, dtype=jnp.int32),
                kv_lens=jnp.full((batch,), pos + 1, jnp.int32),
                page_indices=jnp.asarray(page_indices),
                num_seqs=jnp.asarray([batch], jnp.int32))
            ids = jnp.asarray(np.arange(batch) % config.vocab_size, jnp.int32)
            return ids, jnp.full((batch,), pos, jnp.int32), md, jnp.arange(batch)

        for it in range(args.iters + 1):
            for num_pages, run in runs.items():
                ids, positions, md, rows = inputs(run, it)
                if it == 0:
                    t0 = time.perf_counter()
                    hlo = step.lower(state, run["cache"], ids, positions, md, rows).compile().as_text()
                    run["compile_s"] = time.perf_counter() - t0
                    run["whole_cache_ops"] = count_whole_cache_ops(hlo, run["cache"].k.shape)
                t0 = time.perf_counter()
                tokens, run["cache"] = step(state, run["cache"], ids, positions, md, rows)
                tokens.block_until_ready()
                run["times"].append(time.perf_counter() - t0)
        for num_pages, run in runs.items():
            cache_mb = 2 * run["cache"].k.nbytes / 2**20
            print(f"{batch:>6} {num_pages:>6} {cache_mb:>9.0f} {run['compile_s']:>10.1f} "
                  f"{1e3 * float(np.median(run['times'][1:])):>8.1f} {run['whole_cache_ops']:>16}",
                  flush=True)
        del runs


def count_whole_cache_ops(hlo: str, shape) -> int:
    """Ops (outside fused computations) whose result is a whole cache array and which are not the
    in-place write (dynamic-update-slice / scatter fusions) or plumbing (tuples, loop, params)."""
    import re

    dims = ",".join(str(d) for d in shape)
    pattern = re.compile(r"=\s*\w+\[" + dims + r"\]\S*\s+(\S+?)\(")
    plumbing = ("get-tuple-element", "parameter", "tuple", "while", "bitcast", "conditional")
    count = 0
    for line in hlo.splitlines():
        m = pattern.search(line)
        if not m or m.group(1) in plumbing:
            continue
        if m.group(1) == "fusion" and ("dynamic-update-slice" in line or "scatter" in line):
            continue
        if m.group(1) in ("dynamic-update-slice", "scatter"):
            continue
        count += 1
    return count


if __name__ == "__main__":
    main()
