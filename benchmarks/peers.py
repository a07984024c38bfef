"""Offline throughput against the peers: jaxinfer vs llama.cpp's `llama-server` vs transformers.

    python benchmarks/peers.py [--model smollm2-135m] [--requests 64] [--seed 0]
                               [--only jaxinfer,llama,hf] [--slots 4,8,16,32] [--hf-batch 16]
                               [--engine-arg KEY=JSON ...] [--llama-server PATH]
                               [--llama-threads N] [--no-hf]
                               [--out results.json]

Why: the engine is only worth running if it beats the programs people already have. Each system
gets the same requests, on the same model file, in the same run (this machine's load moves the
numbers between runs, so only ratios within one run mean much).

Workload (seeded, generated here): N requests whose prompts are slices of real English text
(a few paragraphs repeated), tokenized with the model's own tokenizer and cut to exact lengths in
[--min-prompt, --max-prompt] (default 50-700 tokens): --min-prompt plus an exponential of mean
--mean-prompt-extra (106), capped, so that 64 requests hold ~10k prompt tokens, most prompts short
and a few long (`--prompt-dist uniform` draws them uniformly instead, ~24k tokens); output
lengths from an exponential of mean --mean-out (100) capped at --cap-out (384), at least 1. Greedy, and every
request generates exactly its length (EOS ignored): output tokens are the same work everywhere.

- jaxinfer: `LLM(model, **engine_kwargs).generate(token_ids, [SamplingParams(max_tokens=n,
  temperature=0, ignore_eos=True), ...])`, default engine settings unless `--engine-arg` says
  otherwise. Every shape bucket is compiled and a short generate runs first; that warm-up is
  reported separately and not timed.
- llama-server: started on a free port with `-m MODEL.gguf -t $(nproc) -c CTX -np SLOTS
  --cont-batching` (CTX = SLOTS x the longest prompt + output, rounded up to 256) for each SLOTS
  in `--slots`; every request sent at once (one HTTP connection each) to /completion with
  the prompt as token ids, `n_predict`, `ignore_eos`, `temperature: 0`, `cache_prompt: false`;
  timed from the first send to the last response, output tokens counted from `tokens_predicted`.
  The best setting is the baseline of the ratio column. On a machine whose cores other processes
  are also using, `-t $(nproc)` can be many times slower than usual (llama.cpp's threads wait for
  each other at every op, spinning, so one descheduled thread stalls the rest); `--llama-threads`
  sets -t, and the load average printed before and after shows whether the run was shared.
- transformers: the GGUF dequantized to float32 (`from_pretrained(folder, gguf_file=name)`),
  static batches of `--hf-batch` requests in order, left padding, greedy `generate` with
  `min_new_tokens = max_new_tokens =` the batch's largest length; only each request's own length
  counts as output (the rest of its row is the static batch's waste). `--no-hf` skips it.

Prints the machine, the versions and one table: system, setting, output tok/s, seconds, ratio to
llama-server's best. `--out FILE` also writes the results as JSON.

The llama.cpp peer is built from source, not taken from a wheel: the llama.cpp sources vendored in
the llama-cpp-python sdist on PyPI (`pip download --no-binary :all: llama-cpp-python`), configured
with

    cmake -S vendor/llama.cpp -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_OPENSSL=OFF \\
      -DLLAMA_USE_PREBUILT_UI=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \\
      -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \\
      -DGGML_AVX512_VBMI=ON
    cmake --build build -j$(nproc) -t llama-server llama-batched-bench

(the AVX-512 flags OFF on a CPU without avx512f). GGML_NATIVE stays off because a native build
turns on AMX where the CPU reports it, and AMX code crashes in some sandboxes. The peer build
script does exactly this and links the binaries into ~/.cache/jaxinfer-peers, where this script
looks by default (or `--llama-server PATH`, or `$LLAMA_SERVER`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from startup import free_port, stop_server

from jaxinfer.models.loader import model_source
from jaxinfer.tokenizer import Tokenizer

SYSTEMS = ("jaxinfer", "llama", "hf")

TEXT = (
    "The river town woke slowly in the winter. Before dawn the bakers lit their ovens, and the smell "
    "of bread drifted down the narrow streets toward the water, where the ferrymen were already "
    "checking their ropes. Most of the houses had been built two centuries earlier, when the town "
    "grew rich on the grain trade, and their stone fronts still carried the marks of the floods "
    "that came every few decades. The old mill had become a library, and the library had become "
    "the place where children spent their afternoons once school was over.\n\n"
    "A good explanation begins with what the reader already knows. If you want to describe how a "
    "hash table works, start with a row of numbered boxes and a rule that turns any name into a "
    "box number. Only then talk about collisions, about what happens when two names want the same "
    "box, and about why the table must grow before it fills up. Each step should answer a question "
    "the previous step raised, so that the reader never has to hold more than one new idea at a "
    "time.\n\n"
    "In the spring of that year the committee published its report on the state of the railways. "
    "It found that most delays were caused not by the trains themselves but by the signals, many "
    "of which were older than the engineers who maintained them. The report recommended a ten-year "
    "programme of replacement, starting with the busiest junctions, and warned that without it the "
    "network would carry fewer passengers at the end of the decade than at the beginning.\n\n"
)


@dataclasses.dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]  # token ids, exact lengths
    output_lens: list[int]  # exact output lengths (EOS ignored)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def longest(self) -> int:
        return max(len(p) + n for p, n in zip(self.prompts, self.output_lens))


@dataclasses.dataclass(frozen=True)
class Result:
    system: str
    setting: str
    seconds: float
    num_output_tokens: int
    warmup_seconds: float | None = None
    notes: str = ""

    @property
    def tok_s(self) -> float:
        return self.num_output_tokens / self.seconds


# -- the workload ----------------------------------------------------------------------------------
def make_workload(tokenizer: Tokenizer, num_requests: int, seed: int, *, min_prompt: int,
                  max_prompt: int, mean_out: float, cap_out: int, prompt_dist: str = "exp",
                  mean_prompt_extra: float = 106.0) -> Workload:
    """Prompts are windows into the repeated TEXT at random offsets, so each one reads as English
    and none shares a prefix with another (beyond chance)."""
    rng = np.random.default_rng(seed)
    text_ids = tokenizer.encode(TEXT, add_special_tokens=False)
    repeats = math.ceil(2 * max_prompt / len(text_ids)) + 1
    stream = text_ids * repeats
    if prompt_dist == "uniform":
        prompt_lens = rng.integers(min_prompt, max_prompt + 1, size=num_requests)
    else:
        extra = rng.exponential(mean_prompt_extra, size=num_requests).astype(int)
        prompt_lens = np.minimum(min_prompt + extra, max_prompt)
    starts = rng.integers(0, len(text_ids), size=num_requests)
    out_lens = np.clip(rng.exponential(mean_out, size=num_requests).astype(int), 1, cap_out)
    prompts = [stream[s:s + n] for s, n in zip(starts.tolist(), prompt_lens.tolist())]
    return Workload(prompts, [int(n) for n in out_lens])


# -- the machine and versions ----------------------------------------------------------------------
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def jaxinfer_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("jaxinfer")
    except PackageNotFoundError:
        v = "?"
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    try:
        commit = subprocess.run(["git", "-C", root, "describe", "--always", "--dirty"], check=False,
                                capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return f"{v} ({commit})" if commit else v


def llama_version(binary: str) -> str:
    """`llama-server --version` prints e.g. "version: 6543 (abc1234)" (on stderr); the peer build
    keeps the binary under the unpacked sdist's folder, which names the llama-cpp-python release."""
    try:
        p = subprocess.run([binary, "--version"], check=False, capture_output=True, text=True,
                           timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown ({e})"
    found = "unknown"
    for line in (p.stdout + p.stderr).splitlines():
        if line.startswith("version:"):
            found = line.split(":", 1)[1].strip()
    sdist = re.search(r"llama_cpp_python-([\w.]+)", os.path.realpath(binary))
    return f"{found}, from the llama-cpp-python {sdist.group(1)} sdist" if sdist else found


# -- jaxinfer --------------------------------------------------------------------------------------
def parse_engine_args(pairs: list[str]) -> dict:
    """["max_num_seqs=32", "attention_backend=xla"] -> {"max_num_seqs": 32, "attention_backend": "xla"}
    (values are JSON; anything that is not JSON is a string)."""
    kwargs = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--engine-arg {pair!r} must be KEY=VALUE")
        try:
            kwargs[key] = json.loads(value)
        except json.JSONDecodeError:
            kwargs[key] = value
    return kwargs


def engine_setting(engine_config, engine_kwargs: dict) -> str:
    shown = {k: getattr(engine_config, k) for k in ("max_num_seqs", "max_num_batched_tokens")}
    shown.update(engine_kwargs)
    return ", ".join(f"{k}={v}" for k, v in shown.items())


def bench_jaxinfer(model: str, work: Workload, engine_kwargs: dict) -> Result:
    from jaxinfer import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model, **engine_kwargs)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.engine.warmup()  # every shape bucket, so the timed run compiles nothing
    short = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate(work.prompts[:2], short, use_tqdm=False)
    warmup_s = time.perf_counter() - t0
    num_compiled = llm.engine.runner.num_compilations
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in work.output_lens]
    t0 = time.perf_counter()
    outs = llm.generate(work.prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    counts = [len(o.outputs[0].token_ids) for o in outs]
    notes = [f"load {load_s:.0f} s"]
    notes += count_mismatches(counts, work.output_lens)
    if llm.engine.runner.num_compilations != num_compiled:
        notes.append(f"{llm.engine.runner.num_compilations - num_compiled} compilations while timed")
    setting = engine_setting(llm.engine.engine_config, engine_kwargs)
    return Result("jaxinfer", setting, seconds, sum(counts), warmup_s, "; ".join(notes))


def count_mismatches(counts: list[int], expected: list[int]) -> list[str]:
    bad = [(i, c, e) for i, (c, e) in enumerate(zip(counts, expected)) if c != e]
    if not bad:
        return []
    shown = ", ".join(f"#{i}: {c} not {e}" for i, c, e in bad[:3])
    return [f"{len(bad)} requests with the wrong output length ({shown})"]


# -- llama-server ----------------------------------------------------------------------------------
def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def start_llama_server(binary: str, gguf: str, slots: int, ctx: int, threads: int, port: int,
                       log) -> subprocess.Popen:
    cmd = [binary, "-m", gguf, "-t", str(threads), "-c", str(ctx), "-np", str(slots),
           "--cont-batching", "--host", "127.0.0.1", "--port", str(port)]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"llama-server not healthy after {timeout:.0f} s")


async def send_all(url: str, prompts: list[list[int]], output_lens: list[int]) -> tuple[float, list]:
    """Sends every request at once, one connection each; (seconds first send -> last response,
    the JSON bodies, or an error string per failed request)."""
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as http:
        async def one(prompt: list[int], n: int):
            body = {"prompt": prompt, "n_predict": n, "ignore_eos": True, "temperature": 0,
                    "cache_prompt": False, "stream": False}
            try:
                r = await http.post("/completion", json=body)
            except httpx.HTTPError as e:
                return f"{type(e).__name__}: {e}"
            return r.json() if r.status_code == 200 else f"HTTP {r.status_code}: {r.text[:200]}"

        t0 = time.perf_counter()
        bodies = await asyncio.gather(*(one(p, n) for p, n in zip(prompts, output_lens)))
        return time.perf_counter() - t0, bodies


def bench_llama_slots(binary: str, gguf: str, work: Workload, slots: int, threads: int) -> Result:
    ctx = slots * round_up(work.longest, 256)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.NamedTemporaryFile("w+", prefix="llama-server-", suffix=".log") as log:
        proc = start_llama_server(binary, gguf, slots, ctx, threads, port, log)
        try:
            t0 = time.perf_counter()
            wait_healthy(url, proc)
            asyncio.run(send_all(url, work.prompts[:1], [4]))  # a first request, untimed
            warmup_s = time.perf_counter() - t0
            seconds, bodies = asyncio.run(send_all(url, work.prompts, work.output_lens))
        finally:
            stop_server(proc)
        log.seek(0)
        log_errors = [line.strip() for line in log if re.match(r"\s*[\d.]+ E ", line)]
    errors = [b for b in bodies if isinstance(b, str)]
    ok = [(b, p, n) for b, p, n in zip(bodies, work.prompts, work.output_lens) if isinstance(b, dict)]
    notes = [f"{len(errors)} failed requests (first: {errors[0]})"] if errors else []
    notes += count_mismatches([b.get("tokens_predicted", -1) for b, _, _ in ok], [n for _, _, n in ok])
    wrong_prompts = sum(b.get("tokens_evaluated", len(p)) != len(p) for b, p, _ in ok)
    if wrong_prompts:
        notes.append(f"{wrong_prompts} prompts evaluated with another length")
    if log_errors:
        notes.append(f"{len(log_errors)} error lines in its log (first: {log_errors[0][:160]})")
    num_out = sum(b.get("tokens_predicted", 0) for b, _, _ in ok)
    return Result("llama-server", f"{slots} slots, ctx {ctx}, {threads} threads", seconds, num_out, warmup_s,
                  "; ".join(notes))


# -- transformers ----------------------------------------------------------------------------------
def bench_hf(folder: str, gguf_file: str, work: Workload, batch_size: int) -> Result:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the weight-loading bars (the GGUF conversion keeps its own)
    torch.set_num_threads(os.cpu_count() or 1)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file,
                                                 dtype=torch.float32).eval()
    pad_id = model.generation_config.pad_token_id
    if pad_id is None:
        eos = model.generation_config.eos_token_id
        pad_id = eos[0] if isinstance(eos, list) else eos
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    hf_generate(model, work.prompts[:2], 4, pad_id)  # untimed warm-up
    warmup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    counts = []
    for i in range(0, len(work.prompts), batch_size):
        batch, lens = work.prompts[i:i + batch_size], work.output_lens[i:i + batch_size]
        generated = hf_generate(model, batch, max(lens), pad_id)
        counts += [min(n, g) for n, g in zip(lens, generated)]
    seconds = time.perf_counter() - t0
    notes = [f"load {load_s:.0f} s"] + count_mismatches(counts, work.output_lens)
    return Result("transformers", f"static batches of {batch_size}, float32", seconds, sum(counts),
                  warmup_s, "; ".join(notes))


def hf_generate(model, prompts: list[list[int]], num_new: int, pad_id: int) -> list[int]:
    """Greedy, exactly num_new new tokens per row; returns the new tokens each row got."""
    import torch

    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                             max_new_tokens=num_new, min_new_tokens=num_new, pad_token_id=pad_id)
    return [out.shape[1] - width] * len(prompts)


# -- the report ------------------------------------------------------------------------------------
def print_table(results: list[Result]) -> None:
    llama = [r.tok_s for r in results if r.system == "llama-server"]
    base = max(llama) if llama else None
    print(f"{'system':<13} | {'setting':<44} | {'out tok/s':>9} | {'seconds':>7} | "
          f"{'warm-up s':>9} | {'ratio':>6}")
    print("-" * 104)
    for r in results:
        ratio = f"{r.tok_s / base:5.2f}x" if base else "   n/a"
        warm = f"{r.warmup_seconds:9.1f}" if r.warmup_seconds is not None else f"{'':9}"
        print(f"{r.system:<13} | {r.setting[:44]:<44} | {r.tok_s:9.1f} | {r.seconds:7.1f} | "
              f"{warm} | {ratio}")
    notes = [(r, r.notes) for r in results if r.notes]
    for r, note in notes:
        print(f"  {r.system} ({r.setting}): {note}")
    print("ratio = output tok/s / llama-server's best in this run"
          + ("" if base else " (llama-server not run: no baseline)"))


def write_json(path: str, args, header: dict, work: Workload, results: list[Result]) -> None:
    llama = [r.tok_s for r in results if r.system == "llama-server"]
    base = max(llama) if llama else None
    doc = {**header, "args": vars(args),
           "workload": {"requests": len(work.prompts), "prompt_tokens": work.num_prompt_tokens,
                        "output_tokens": work.num_output_tokens},
           "results": [{**dataclasses.asdict(r), "output_tok_s": r.tok_s,
                        "ratio": r.tok_s / base if base else None} for r in results]}
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    default_server = os.environ.get("LLAMA_SERVER") or os.path.expanduser(
        "~/.cache/jaxinfer-peers/llama-server")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="a known name or a .gguf file")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-prompt", type=int, default=50)
    ap.add_argument("--max-prompt", type=int, default=700)
    ap.add_argument("--prompt-dist", choices=["exp", "uniform"], default="exp")
    ap.add_argument("--mean-prompt-extra", type=float, default=106.0,
                    help="exp: the mean prompt length above --min-prompt")
    ap.add_argument("--mean-out", type=float, default=100.0)
    ap.add_argument("--cap-out", type=int, default=384)
    ap.add_argument("--only", default=",".join(SYSTEMS), help="a subset of jaxinfer,llama,hf")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="an EngineConfig field for jaxinfer, VALUE as JSON (repeatable)")
    ap.add_argument("--llama-server", default=default_server,
                    help="the llama-server binary (default $LLAMA_SERVER or the peer build's)")
    ap.add_argument("--slots", default="4,8,16,32", help="llama-server -np values to sweep")
    ap.add_argument("--llama-threads", type=int, default=os.cpu_count() or 1,
                    help="llama-server -t (default: every core; on a machine shared with other "
                         "busy processes fewer threads can be much faster, see the docstring)")
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--out", help="also write the results as JSON here")
    args = ap.parse_args(argv)
    systems = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        ap.error(f"--only: unknown systems {sorted(unknown)} (choose from {', '.join(SYSTEMS)})")
    args.systems = [s for s in systems if not (args.no_hf and s == "hf")]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    source = model_source(args.model)
    if not source.is_gguf and {"llama", "hf"} & set(args.systems):
        raise SystemExit(f"{args.model!r} is not a .gguf file: llama-server and the transformers "
                         "run load the GGUF (use --only jaxinfer)")
    if "llama" in args.systems and not os.access(args.llama_server, os.X_OK):
        raise SystemExit(f"no llama-server at {args.llama_server!r}: build it (see this file's "
                         "docstring) or pass --llama-server PATH")
    tokenizer = Tokenizer.from_source(source.path, source.gguf_file)
    work = make_workload(tokenizer, args.requests, args.seed, min_prompt=args.min_prompt,
                         max_prompt=args.max_prompt, mean_out=args.mean_out, cap_out=args.cap_out,
                         prompt_dist=args.prompt_dist, mean_prompt_extra=args.mean_prompt_extra)
    header = {"cpu": cpu_model(), "cores": os.cpu_count(), "jaxinfer": jaxinfer_version(),
              "llama.cpp": llama_version(args.llama_server) if "llama" in args.systems else None,
              "model": source.file, "load_average_before": load_average()}
    print(f"machine: {header['cpu']}, {header['cores']} cores; load average {header['load_average_before']}")
    print(f"jaxinfer {header['jaxinfer']}; llama.cpp {header['llama.cpp'] or 'not run'}")
    print(f"workload: {len(work.prompts)} requests, {work.num_prompt_tokens} prompt tokens "
          f"({args.min_prompt}-{args.max_prompt} each, {args.prompt_dist}), "
          f"{work.num_output_tokens} output tokens "
          f"(exp mean {args.mean_out:g}, cap {args.cap_out}), greedy, EOS ignored; seed {args.seed}",
          flush=True)

    results: list[Result] = []
    if "jaxinfer" in args.systems:
        results.append(bench_jaxinfer(args.model, work, parse_engine_args(args.engine_arg)))
        report_progress(results[-1])
        gc.collect()
    if "llama" in args.systems:
        for slots in [int(s) for s in args.slots.split(",") if s.strip()]:
            results.append(bench_llama_slots(args.llama_server, source.file, work, slots,
                                             args.llama_threads))
            report_progress(results[-1])
    if "hf" in args.systems:
        results.append(bench_hf(source.path, source.gguf_file, work, args.hf_batch))
        report_progress(results[-1])

    header["load_average_after"] = load_average()
    print(f"\nOffline throughput, {os.path.basename(source.file)}, {len(work.prompts)} requests; "
          f"load average before {header['load_average_before']}, after {header['load_average_after']}")
    print_table(results)
    if args.out:
        write_json(args.out, args, header, work, results)


def report_progress(r: Result) -> None:
    print(f"[{r.system}] {r.setting}: {r.tok_s:.1f} out tok/s, {r.seconds:.1f} s"
          + (f" ({r.notes})" if r.notes else ""), flush=True)


if __name__ == "__main__":
    main()
