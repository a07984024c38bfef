"""`jaxinfer serve`: build the engine, warm it up behind /health, and run the app under uvicorn.

    parser = argparse.ArgumentParser(); add_serve_args(parser); run_serve(parser.parse_args())

Engine settings come from EngineConfig's defaults, then a TOML preset (`--config FILE`, keys of
EngineConfig at the top level or under [engine]), then the engine flags given on the command line.
jaxinfer's serialized steps are cached by default (`~/.cache/jaxinfer/jax`,
runtime/executable_cache.py), so a second start neither compiles nor traces them; JAX's own
persistent cache stays off (`enable_compilation_cache`); a GGUF model's converted weights and
tokenizer are cached too (`~/.cache/jaxinfer`, see jaxinfer/disk_cache.py; JAXINFER_NO_CACHE=1
turns those off). SIGTERM/SIGINT: admissions stop at once (503), requests in flight
finish (up to --shutdown-timeout seconds), then the process exits with status 0.

It logs at INFO by default (serve/logs.py): the model, the KV pool, the warm-up's progress, one
`ready: http://HOST:PORT (N executables, T s)` line once /health answers 200, and an access line
per request (serve/access_log.py; uvicorn's own access log is off). --log-level and
--no-access-log change that.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import os
import signal
import sys
import threading
import time
import tomllib

import jax
import uvicorn

from jaxinfer import disk_cache
from jaxinfer.config import EngineConfig
from jaxinfer.config_args import add_engine_args, engine_kwargs
from jaxinfer.engine.replicas import make_engine, run_follower
from jaxinfer.engine.async_engine import AsyncEngine
from serve import DEFAULT_MAX_BODY_BYTES
from serve.app import create_app
from serve.files_cli import add_files_args, files_config
from serve.logs import LEVELS, configure_logging, log_level_arg

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
API_KEY_ENV = "JAXINFER_API_KEY"


def default_compilation_cache_dir() -> str:
    """<cache root>/jax: under JAXINFER_CACHE_DIR when set, like every other cache
    (jaxinfer/disk_cache.py), so one variable moves them all."""
    return str(disk_cache.cache_root() / "jax")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """The server's flags, then every engine flag (generated from EngineConfig)."""
    parser.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                        help="HF checkpoint directory, .gguf file or a known name "
                             f"(default: {DEFAULT_MODEL})")
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default: 127.0.0.1, this machine only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None,
                   help=f"require `Authorization: Bearer KEY` (default: ${API_KEY_ENV} if set; "
                        "prefer the variable: command lines are visible to other users)")
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the model argument's name)")
    g.add_argument("--tokenizer", default=None, help="tokenizer path (default: the model's own)")
    g.add_argument("--config", metavar="FILE", default=None,
                   help="TOML engine preset (EngineConfig fields); flags given here override it")
    g.add_argument("--max-waiting", type=int, default=1024,
                   help="requests waiting for their first token before new ones get 503")
    g.add_argument("--max-step-failures", type=int, default=3,
                   help="consecutive failed engine steps after which /health answers 503")
    g.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="larger request bodies get 413")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish on SIGTERM")
    g.add_argument("--compilation-cache-dir", default=default_compilation_cache_dir(),
                   help="jaxinfer's compiled steps (default: %(default)s)")
    g.add_argument("--no-compilation-cache", action="store_true",
                   help="do not read or write the compiled steps' cache")
    g.add_argument("--no-warmup", action="store_true",
                   help="skip compiling every shape bucket before /health turns 200")
    g.add_argument("--log-level", type=log_level_arg, choices=LEVELS, default=argparse.SUPPRESS,
                   help="INFO (default): start-up, warm-up progress, ready, one line per request; "
                        "DEBUG adds each compiled step shape")
    g.add_argument("--no-access-log", action="store_true",
                   help="no log line per request")
    g.add_argument("--no-webui", action="store_true",
                   help="no chat and dashboard page on / (it is served without the API key)")
    add_files_args(parser)
    add_engine_args(parser)


def load_preset(path: str) -> dict:
    """EngineConfig fields from a TOML file (top level or an [engine] table)."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ValueError(f"--config {path!r}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--config {path!r} is not valid TOML: {e}") from None
    table = data.get("engine", data)
    if not isinstance(table, dict):
        raise ValueError(f"--config {path!r}: [engine] must be a table")
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(table) - known - {"engine"})
    if unknown:
        raise ValueError(f"--config {path!r}: unknown engine settings {unknown}; "
                         f"known: {sorted(known)}")
    return {k: v for k, v in table.items() if k in known}


def engine_settings(args: argparse.Namespace) -> dict:
    """Preset (if any) overridden by the engine flags given (every engine flag defaults to None,
    so only flags on the command line appear in `engine_kwargs`)."""
    settings = load_preset(args.config) if args.config else {}
    settings.update(engine_kwargs(args))
    return settings


def enable_compilation_cache(path: str) -> None:
    """jaxinfer's executable cache under `path` (it follows jax_compilation_cache_dir), with
    JAX's own persistent cache turned off: an XLA:CPU step that JAX restores from its cache runs,
    but serialized again into jaxinfer's cache it comes back unable to run ("Function ... not
    found"), so jaxinfer's cache must only ever get freshly compiled steps. The price: the few
    small jitted functions outside the step, and a draft model's steps, compile at every start."""
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_enable_compilation_cache", False)


def served_name(model: str) -> str:
    name = os.path.basename(os.path.normpath(model)) if os.path.exists(model) else model
    return name[:-5] if name.endswith(".gguf") else name


def resolve_api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else $JAXINFER_API_KEY, else None (no key required)."""
    return args.api_key or os.environ.get(API_KEY_ENV) or None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run_serve(args: argparse.Namespace) -> int:
    started = time.monotonic()
    api_key = resolve_api_key(args)
    if not _is_loopback(args.host) and api_key is None:
        logger.warning("serving on %s without an API key: anyone who can reach it can use it",
                       args.host)
    if not args.no_compilation_cache:
        enable_compilation_cache(args.compilation_cache_dir)
    settings = engine_settings(args)
    t0 = time.perf_counter()
    engine = make_engine(args.model, tokenizer=args.tokenizer, **settings)  # dp > 1: replicas
    if run_follower(engine):  # processes 1.. of a multi-process engine: no server of their own
        return 0
    logger.info("engine built in %.1f s%s", time.perf_counter() - t0,
                f" ({settings})" if settings else "")
    async_engine = AsyncEngine(engine, max_waiting=args.max_waiting, warmup=not args.no_warmup,
                               max_step_failures=args.max_step_failures)
    app = create_app(async_engine, api_key=api_key, max_body_bytes=args.max_body_bytes,
                     served_model_name=args.served_model_name or served_name(args.model),
                     shutdown_timeout=args.shutdown_timeout, access_log=not args.no_access_log,
                     files=files_config(args), webui=not args.no_webui)
    serve_app(app, async_engine, host=args.host, port=args.port,
              shutdown_timeout=args.shutdown_timeout, started=started)
    return 0


def serve_app(app, async_engine, *, host: str, port: int, shutdown_timeout: float = 30.0,
              started: float | None = None) -> None:
    """Runs `app` under uvicorn until SIGTERM/SIGINT, then drains (see the module doc).
    `started` (time.monotonic()): when the process began, for the ready line's seconds."""
    server = make_server(app, async_engine, host=host, port=port,
                         shutdown_timeout=shutdown_timeout, started=started)
    with _drained_exit_is_clean():
        server.run()


def make_server(app, async_engine, *, host: str, port: int, shutdown_timeout: float = 30.0,
                started: float | None = None) -> uvicorn.Server:
    """The uvicorn server of `app`: logging left to ours (no log config of its own, its access
    log off), the ready line once the engine is warm."""
    config = uvicorn.Config(app, host=host, port=port, lifespan="on", access_log=False,
                            log_config=None, timeout_graceful_shutdown=shutdown_timeout + 5.0,
                            timeout_keep_alive=30)
    return _UvicornServer(config, async_engine,
                          started if started is not None else time.monotonic())


@contextlib.contextmanager
def _drained_exit_is_clean():
    """uvicorn handles SIGTERM/SIGINT itself (stop, drain) and, once shut down, re-raises the
    signal against the handlers it found, so a clean drain would end the process with -15 (or a
    KeyboardInterrupt). Handlers that ignore that re-raise make it a normal return (exit 0)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _UvicornServer(uvicorn.Server):
    """Logs `ready: URL (N executables, T s)` once it listens and the engine is warm; stops
    admissions the moment SIGTERM/SIGINT arrives (uvicorn then drains the connections)."""

    def __init__(self, config: uvicorn.Config, async_engine, started: float):
        super().__init__(config)
        self.async_engine = async_engine
        self.started_at = started  # `started` is uvicorn's (a bool)
        self._announcing: asyncio.Task | None = None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if not self.should_exit:
            self._announcing = asyncio.create_task(self._announce_ready())

    async def shutdown(self, sockets=None) -> None:
        if self._announcing is not None:
            self._announcing.cancel()
        await super().shutdown(sockets=sockets)

    async def _announce_ready(self) -> None:
        ae = self.async_engine
        while not ae.is_ready and ae.warmup_error is None:
            await asyncio.sleep(_READY_POLL_S)
        if ae.warmup_error is not None:
            logger.error("not ready: the warm-up failed (%s: %s); /health answers 503",
                         type(ae.warmup_error).__name__, ae.warmup_error)
            return
        snapshot = ae.metrics_snapshot
        logger.info("ready: %s (%d executables, %.1f s)", _url(self.config.host, self.config.port),
                    snapshot.num_compilations if snapshot is not None else 0,
                    time.monotonic() - self.started_at)

    def handle_exit(self, sig, frame) -> None:
        self.async_engine.stop_admissions()
        super().handle_exit(sig, frame)


_READY_POLL_S = 0.05


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxinfer serve", description=__doc__.splitlines()[0])
    add_serve_args(parser)
    args = parser.parse_args(argv)
    configure_logging(getattr(args, "log_level", "INFO"))
    try:
        return run_serve(args)
    except ValueError as e:
        print(f"jaxinfer serve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
