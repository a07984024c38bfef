"""Soak of the HTTP server: N clients at once for T seconds sending a mix of good, dropped, aborted
and bad requests to a real `jaxinfer serve` process; afterwards nothing may be leaked or broken.

    python benchmarks/soak.py [MODEL] [--clients 64] [--seconds 600] [--seed 0]
                              [-- extra `jaxinfer serve` flags]

MODEL "tiny" (the default) is a tiny random Llama written to a temporary folder (needs torch and
transformers, as the tests do); any other is what `jaxinfer serve` takes. The script starts the
server (127.0.0.1, a free port, warm-up on) and runs `--clients` loops; each sends one request
after another until `--seconds` have passed, its kind drawn at random (seeded) with KIND_WEIGHTS:

- stream: a streaming chat or text completion (greedy or sampled, 8-64 tokens, EOS ignored) read
  to `data: [DONE]`; it must end with 200 and no error event. Its end-to-end latency is recorded.
- disconnect: a streaming request of 48-96 tokens that the client closes after 1-4 events.
- abort: a streaming or plain request cancelled 5-300 ms after it is sent, mostly before the first
  byte comes back (one answered before that counts under its status).
- bad: malformed JSON, a wrong type, an out-of-range value, an unknown model, or a prompt longer
  than the model's context; each must get a 4xx.

Why: a server that runs for days sees every one of these at once; a leaked page, a task that
outlives its client or a slow memory growth shows only after many of them. Afterwards the script
waits for the engine to settle (no KV page in use, up to `--settle-seconds`) and prints a markdown
table by kind (sent, completed, 4xx, 5xx, disconnected, aborted, other errors, p50 / p99 latency of
the completed) and one of the checks: 5xx seen by clients and counted by the server's /metrics,
KV pages in use after the run, /health, the server's RSS (VmRSS) after warm-up and at the end.
Exit status 1 when a check fails: any 5xx, any other error (a transport error, an error event, a
bad request answered 2xx, a good one answered 4xx), a KV page still in use, /health not 200, or a
server that exited.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fuzz import kv_pages_used
from overload import pct, tiny_model
from startup import (
    free_port,
    parse_with_server_flags,
    start_server,
    stop_server,
    wait_ready,
)

KIND_WEIGHTS = (("stream", 0.55), ("disconnect", 0.15), ("abort", 0.15), ("bad", 0.15))
PROMPTS = ("The quick brown fox jumps over the lazy dog.", "Once upon a time there was",
           "Paged attention keeps the KV cache in fixed-size pages.", "def main():\n",
           "Hello, world! How are you today?")


@dataclasses.dataclass
class Tally:
    """The outcomes of one kind of request."""

    sent: int = 0
    completed: int = 0
    status_4xx: int = 0
    status_5xx: int = 0
    disconnected: int = 0
    aborted: int = 0
    errors: int = 0
    latencies: list[float] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    def error(self, note: str) -> None:
        self.errors += 1
        self.note(note)

    def note(self, note: str) -> None:
        if len(self.notes) < 5:  # the first few, printed under the table
            self.notes.append(note[:300])


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def server_5xx(url: str) -> int:
    """Generation requests the server counted with a 5xx outcome (jaxinfer_requests_total)."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("jaxinfer_requests_total{") and 'outcome="5' in line:
            total += float(line.split()[-1])
    return int(total)


def generation_body(rng: random.Random, model: str, max_tokens: int, stream: bool) -> tuple:
    """(path, body) of a valid chat or text completion."""
    prompt = f"{rng.choice(PROMPTS)} {rng.randrange(1000)}"
    sampling = ({"temperature": 0} if rng.random() < 0.5 else
                {"temperature": 0.8, "top_p": 0.9, "seed": rng.randrange(1 << 30)})
    body = {"model": model, "max_tokens": max_tokens, "stream": stream, "ignore_eos": True,
            **sampling}
    if rng.random() < 0.5:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", {**body, "prompt": prompt}


def bad_request(rng: random.Random, model: str, max_model_len: int) -> tuple[str, bytes]:
    """(path, raw body) of a request the server must refuse with a 4xx."""
    long_prompt = "hello " * (max_model_len + 16)  # at least one token a word
    bodies = (
        ("/v1/chat/completions", b'{"model": "' + model.encode() + b'", "messages": [{"role": '),
        ("/v1/completions", {"model": model, "prompt": "Hi", "max_tokens": "ten"}),
        ("/v1/chat/completions", {"model": model, "messages": "not a list"}),
        ("/v1/completions", {"model": model, "prompt": 42.5}),
        ("/v1/completions", {"model": model, "prompt": "Hi", "temperature": -1}),
        ("/v1/chat/completions", {"model": "no-such-model",
                                  "messages": [{"role": "user", "content": "Hi"}]}),
        ("/v1/completions", {"model": model, "prompt": long_prompt, "max_tokens": 4,
                             "stream": rng.random() < 0.5}),
    )
    path, body = rng.choice(bodies)
    return path, body if isinstance(body, bytes) else json.dumps(body).encode()


async def read_stream(response: httpx.Response, tally: Tally, stop_after: int | None) -> str:
    """Reads SSE events: "done" at [DONE], "dropped" after `stop_after` events, "error" at an
    error event, "short" if the stream ends without [DONE]."""
    events = 0
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        payload = line[len("data: "):]
        if payload == "[DONE]":
            return "done"
        if '"error"' in payload and "error" in json.loads(payload):
            tally.error(f"error event: {payload}")
            return "error"
        events += 1
        if stop_after is not None and events >= stop_after:
            return "dropped"
    tally.error("the stream ended without [DONE]")
    return "short"


def count_status(tally: Tally, status: int, text: str, expect_4xx: bool) -> None:
    if status >= 500:
        tally.status_5xx += 1
        tally.note(f"{status}: {text}")
    elif 400 <= status < 500:
        tally.status_4xx += 1
        if not expect_4xx:
            tally.error(f"{status}: {text}")
    elif expect_4xx:
        tally.error(f"{status} for a bad request: {text}")
    else:
        tally.completed += 1


async def one_stream(http, rng, model, tally: Tally) -> None:
    path, body = generation_body(rng, model, rng.randint(8, 64), stream=True)
    t0 = time.perf_counter()
    async with http.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            count_status(tally, r.status_code, (await r.aread()).decode(errors="replace"), False)
            return
        if await read_stream(r, tally, None) == "done":
            tally.completed += 1
            tally.latencies.append(time.perf_counter() - t0)


async def one_disconnect(http, rng, model, tally: Tally) -> None:
    path, body = generation_body(rng, model, rng.randint(48, 96), stream=True)
    async with http.stream("POST", path, json=body) as r:  # leaving it closes the connection
        if r.status_code != 200:
            count_status(tally, r.status_code, (await r.aread()).decode(errors="replace"), False)
            return
        outcome = await read_stream(r, tally, rng.randint(1, 4))
        if outcome == "dropped":
            tally.disconnected += 1
        elif outcome == "done":
            tally.completed += 1


async def one_abort(http, rng, model, tally: Tally) -> None:
    stream = rng.random() < 0.5
    path, body = generation_body(rng, model, 64, stream=stream)
    try:
        r = await asyncio.wait_for(http.post(path, json=body), rng.uniform(0.005, 0.3))
    except TimeoutError:
        tally.aborted += 1
        return
    count_status(tally, r.status_code, r.text, False)


async def one_bad(http, rng, model, tally: Tally, max_model_len: int) -> None:
    path, raw = bad_request(rng, model, max_model_len)
    r = await http.post(path, content=raw, headers={"Content-Type": "application/json"})
    count_status(tally, r.status_code, r.text, True)


async def client_loop(http, seed: int, model: str, max_model_len: int, deadline: float,
                      tallies: dict[str, Tally]) -> None:
    rng = random.Random(seed)
    kinds, weights = zip(*KIND_WEIGHTS)
    while time.monotonic() < deadline:
        kind = rng.choices(kinds, weights)[0]
        tally = tallies[kind]
        tally.sent += 1
        try:
            if kind == "stream":
                await one_stream(http, rng, model, tally)
            elif kind == "disconnect":
                await one_disconnect(http, rng, model, tally)
            elif kind == "abort":
                await one_abort(http, rng, model, tally)
            else:
                await one_bad(http, rng, model, tally, max_model_len)
        except httpx.HTTPError as e:
            tally.error(f"{type(e).__name__}: {e}")


async def soak(url: str, model: str, max_model_len: int, clients: int, seconds: float,
               seed: int) -> dict[str, Tally]:
    tallies = {kind: Tally() for kind, _ in KIND_WEIGHTS}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
        tasks = [asyncio.create_task(client_loop(http, seed * 100_003 + i, model, max_model_len,
                                                 deadline, tallies)) for i in range(clients)]
        t0 = time.monotonic()
        while (await asyncio.wait(tasks, timeout=30))[1]:  # a progress line every 30 s
            sent = sum(t.sent for t in tallies.values())
            print(f"  {time.monotonic() - t0:6.0f} s: {sent} requests, "
                  f"{sum(t.status_5xx for t in tallies.values())} 5xx, "
                  f"{sum(t.errors for t in tallies.values())} other errors", flush=True)
        for t in tasks:
            t.result()
    return tallies


def settle(url: str, timeout: float) -> float:
    """KV pages in use once they reach 0, or after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        pages = kv_pages_used(url)
        if pages == 0 or time.monotonic() > deadline:
            return pages
        time.sleep(0.5)


def total_of(tallies) -> Tally:
    total = Tally()
    for t in tallies:
        for f in dataclasses.fields(Tally):
            setattr(total, f.name, getattr(total, f.name) + getattr(t, f.name))
    return total


def print_tables(tallies: dict[str, Tally], checks: list[tuple[str, str, bool]]) -> None:
    print("| kind | sent | completed | 4xx | 5xx | disconnected | aborted | other errors "
          "| p50 s | p99 s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for kind, t in [*tallies.items(), ("total", total_of(tallies.values()))]:
        lat = (f"{pct(t.latencies, 0.5):.2f} | {pct(t.latencies, 0.99):.2f}" if t.latencies
               else "- | -")
        print(f"| {kind} | {t.sent} | {t.completed} | {t.status_4xx} | {t.status_5xx} "
              f"| {t.disconnected} | {t.aborted} | {t.errors} | {lat} |")
    print()
    print("| check | value | ok |")
    print("| --- | --- | --- |")
    for name, value, ok in checks:
        print(f"| {name} | {value} | {'yes' if ok else 'NO'} |")
    for kind, t in tallies.items():
        for note in t.notes:
            print(f"  {kind}: {note}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default="tiny")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--seconds", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--settle-seconds", type=float, default=30.0)
    p.add_argument("--ready-timeout", type=float, default=3600.0)
    args, extra = parse_with_server_flags(p)
    with tempfile.TemporaryDirectory(prefix="jaxinfer-soak-") as tmp:
        model = tiny_model(tmp) if args.model == "tiny" else args.model
        if args.model == "tiny":
            extra = ["--max-model-len", "256", "--page-size", "8", *extra]
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log_path = os.path.join(tmp, "server.log")
        proc = start_server(model, port, ["--no-access-log", "--data-dir",
                                          os.path.join(tmp, "data"), *extra], log_path=log_path)
        try:
            ready = wait_ready(url, proc, args.ready_timeout)
            card = httpx.get(f"{url}/v1/models").json()["data"][0]
            name, max_model_len = card["id"], card["max_model_len"]
            asyncio.run(soak(url, name, max_model_len, 4, 3.0, args.seed + 1))  # first requests
            rss_start = rss_mib(proc.pid)
            print(f"ready after {ready:.1f} s; {args.clients} clients for {args.seconds:.0f} s "
                  f"against {name} (max_model_len {max_model_len}), seed {args.seed}, "
                  f"RSS {rss_start:.0f} MiB", flush=True)
            t0 = time.monotonic()
            tallies = asyncio.run(soak(url, name, max_model_len, args.clients, args.seconds,
                                       args.seed))
            elapsed = time.monotonic() - t0
            pages = settle(url, args.settle_seconds)
            health = httpx.get(f"{url}/health").status_code
            rss_end = rss_mib(proc.pid)
            counted_5xx = server_5xx(url)
            alive = proc.poll() is None
            seen_5xx = sum(t.status_5xx for t in tallies.values())
            errors = sum(t.errors for t in tallies.values())
            print(f"\n{sum(t.sent for t in tallies.values())} requests in {elapsed:.0f} s\n")
            print_tables(tallies, [
                ("5xx seen by clients", str(seen_5xx), seen_5xx == 0),
                ("5xx counted by the server (/metrics)", str(counted_5xx), counted_5xx == 0),
                ("other errors", str(errors), errors == 0),
                ("KV pages in use after the run", f"{pages:.0f}", pages == 0),
                ("/health", str(health), health == 200),
                ("server process", "running" if alive else f"exited {proc.returncode}", alive),
                ("RSS after warm-up / at the end",
                 f"{rss_start:.0f} / {rss_end:.0f} MiB ({rss_end - rss_start:+.0f} MiB)", True),
            ])
            ok = seen_5xx == counted_5xx == errors == 0 and pages == 0 and health == 200 and alive
            if not ok:
                with open(log_path, errors="replace") as f:
                    print("server log (tail):\n" + f.read()[-3000:])
            return 0 if ok else 1
        finally:
            stop_server(proc)


if __name__ == "__main__":
    sys.exit(main())
