"""Time from `jaxinfer serve` to a ready /health: cold (empty compilation cache) and warm.

    python benchmarks/startup.py [MODEL] [--runs 1] [-- extra `jaxinfer serve` flags]

Each run starts a fresh server process on 127.0.0.1 (a free port), polls /health until 200 (the
engine has loaded and compiled every shape bucket), and stops it with SIGTERM. "cold" starts with
empty caches (JAX's compilation cache and jaxinfer's executable, weight and tokenizer caches, all
in a temporary directory), "warm" with what the cold run left there, "no cache" with none at all.
Prints a table: seconds to ready, of which building the engine (weights, tokenizer, KV pool) and
warming up (every shape bucket compiled or loaded), the rest being Python imports and the server's
own start; how many executables were compiled and how many loaded; the ratio cold / warm.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, port: int, extra_args: list[str], *, log_path: str,
                 env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "jaxinfer.cli", "--log-level", "INFO", "serve", model,
           "--host", "127.0.0.1", "--port", str(port), *extra_args]
    log = open(log_path, "w")
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})})


def wait_ready(url: str, proc: subprocess.Popen | None, timeout: float) -> float:
    """Seconds until GET {url}/health answers 200; raises if the process dies or time runs out."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url}/health not ready after {timeout:.0f} s")


@contextlib.contextmanager
def served(args: argparse.Namespace, extra: list[str], name: str):
    """The URL of the server to measure: `args.url` as given, or a `jaxinfer serve args.model`
    with the `extra` flags started here (log in the temporary folder, `args.api_key` passed on),
    ready before it is yielded and stopped after."""
    if args.url is not None:
        wait_ready(args.url, None, args.ready_timeout)
        yield args.url
        return
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = os.path.join(tempfile.gettempdir(), f"jaxinfer-{name}-{port}.log")
    print(f"starting jaxinfer serve {args.model} {' '.join(extra)} (log: {log_path})")
    proc = start_server(args.model, port, extra, log_path=log_path,
                        env={"JAXINFER_API_KEY": args.api_key} if args.api_key else None)
    try:
        print(f"ready after {wait_ready(url, proc, args.ready_timeout):.1f} s")
        yield url
    finally:
        stop_server(proc)


def stop_server(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def time_to_ready(model: str, extra_args: list[str], timeout: float, log_path: str,
                  env: dict | None = None) -> dict:
    """{"ready": s, "build": s, "warmup": s, "compiled": n, "loaded": n} (all but the first
    parsed from the server's log)."""
    port = free_port()
    t0 = time.monotonic()
    proc = start_server(model, port, extra_args, log_path=log_path, env=env)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, timeout)
        ready = time.monotonic() - t0
    except BaseException:
        with open(log_path, errors="replace") as f:
            sys.stderr.write(f.read()[-3000:])
        raise
    finally:
        stop_server(proc)
    with open(log_path, errors="replace") as f:
        log = f.read()
    build = re.search(r"engine built in ([0-9.]+) s", log)
    warmup = re.search(r"engine warm-up took ([0-9.]+) s", log)
    return {"ready": ready, "build": float(build.group(1)) if build else float("nan"),
            "warmup": float(warmup.group(1)) if warmup else float("nan"),
            "compiled": len(re.findall(r"compiled a step for", log)),
            "loaded": len(re.findall(r"loaded a step for", log))}


def dir_size_mb(path: str) -> float:
    total = 0
    for dirpath, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files)
    return total / 2**20


def parse_with_server_flags(parser: argparse.ArgumentParser,
                            argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """The script's own flags, and those after `--` (passed on to `jaxinfer serve`)."""
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    return parser.parse_args(argv[:split]), argv[split + 1:]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default="smollm2-135m")
    p.add_argument("--runs", type=int, default=1, help="warm runs (the cold one is always one)")
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--no-cache-run", action="store_true", help="also time a start with no cache")
    args, extra = parse_with_server_flags(p)
    cache_dir = tempfile.mkdtemp(prefix="jaxinfer-startup-")
    jax_cache = os.path.join(cache_dir, "jax")
    env = {"JAXINFER_CACHE_DIR": os.path.join(cache_dir, "jaxinfer")}  # weights, tokenizer
    log_path = os.path.join(cache_dir + "-server.log")
    rows = []
    try:
        if args.no_cache_run:
            rows.append(("no cache", time_to_ready(args.model, [*extra, "--no-compilation-cache"],
                                                   args.timeout, log_path,
                                                   {"JAXINFER_NO_CACHE": "1"}), 0.0))
        with_cache = [*extra, "--compilation-cache-dir", jax_cache]
        cold = time_to_ready(args.model, with_cache, args.timeout, log_path, env)
        rows.append(("cold (empty caches)", cold, dir_size_mb(cache_dir)))
        for i in range(args.runs):
            warm = time_to_ready(args.model, with_cache, args.timeout, log_path, env)
            rows.append((f"warm #{i + 1}", warm, dir_size_mb(cache_dir)))
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
        if os.path.exists(log_path):
            os.unlink(log_path)
    print(f"\nstartup of `jaxinfer serve {args.model} {' '.join(extra)}` to a ready /health")
    print(f"{'run':<20} {'to ready s':>10} {'engine build s':>14} {'warm-up s':>10} "
          f"{'rest s':>7} {'compiled':>8} {'loaded':>7} {'caches MB':>9}")
    for name, t, mb in rows:
        rest = t["ready"] - t["build"] - t["warmup"]
        print(f"{name:<20} {t['ready']:>10.1f} {t['build']:>14.1f} {t['warmup']:>10.1f} "
              f"{rest:>7.1f} {t['compiled']:>8} {t['loaded']:>7} {mb:>9.1f}")
    warm_best = min((t for n, t, _ in rows if n.startswith("warm")), key=lambda t: t["ready"])
    print(f"cold / warm: {cold['ready'] / warm_best['ready']:.2f}x to ready, "
          f"{cold['warmup'] / warm_best['warmup']:.2f}x warm-up")
    return 0


if __name__ == "__main__":
    sys.exit(main())
