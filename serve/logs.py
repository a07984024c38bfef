"""Logging of the command line (`jaxinfer serve`, and `generate`/`batch` with -v): the standard
`logging` module, one line format on stderr, and per-item detail kept for --log-level DEBUG.

At INFO a server says what it is doing and no more: the model and its weights, the KV pool, the
warm-up's progress, `ready: http://HOST:PORT`, and one access line per request
(serve/access_log.py). The runtime's line per compiled step shape, httpx's line per request
(batch jobs post to the app through httpx) and JAX's notes on backends it did not find are
DEBUG-level detail: their loggers are set to WARNING unless the level is DEBUG.
"""

from __future__ import annotations

import logging

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DETAIL_LOGGERS = ("jaxinfer.runtime", "httpx", "jax")


def configure_logging(level: str) -> None:
    """Root logger at `level` (one of LEVELS, any case) with FORMAT on stderr; DETAIL_LOGGERS at
    WARNING unless `level` is DEBUG."""
    level = level.upper()
    if level not in LEVELS:
        raise ValueError(f"log level {level!r} must be one of {', '.join(LEVELS)}")
    logging.basicConfig(level=level, format=FORMAT, force=True)
    detail = logging.NOTSET if level == "DEBUG" else logging.WARNING
    for name in DETAIL_LOGGERS:
        logging.getLogger(name).setLevel(detail)


def log_level_arg(value: str) -> str:
    """argparse `type` of --log-level: the level's name, upper case."""
    return value.upper()
