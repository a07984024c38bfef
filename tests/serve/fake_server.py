"""A real uvicorn server over the fake engine, for process-level tests (no JAX, starts in ~1 s).

    python -m tests.serve.fake_server --port 8123 [--step-delay-s 0.01] [--api-key K] [--data-dir D]
"""

from __future__ import annotations

import argparse
import time

from jaxinfer.engine.async_engine import AsyncEngine
from serve.app import create_app
from serve.cli import serve_app
from serve.files_config import FilesConfig
from serve.logs import configure_logging
from tests.serve.fake_engine import FakeEngine


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--step-delay-s", type=float, default=0.002)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--api-key", default=None)
    p.add_argument("--shutdown-timeout", type=float, default=20.0)
    p.add_argument("--model-name", default="fake-model")
    p.add_argument("--no-access-log", action="store_true")
    p.add_argument("--data-dir", default=None, help="serve /v1/files and /v1/batches from it")
    args = p.parse_args()
    started = time.monotonic()
    configure_logging("INFO")
    engine = FakeEngine(step_delay_s=args.step_delay_s, max_num_seqs=args.max_num_seqs,
                        max_model_len=args.max_model_len)
    async_engine = AsyncEngine(engine)
    app = create_app(async_engine, api_key=args.api_key, served_model_name=args.model_name,
                     shutdown_timeout=args.shutdown_timeout, access_log=not args.no_access_log,
                     files=FilesConfig(data_dir=args.data_dir) if args.data_dir else None)
    serve_app(app, async_engine, host="127.0.0.1", port=args.port,
              shutdown_timeout=args.shutdown_timeout, started=started)


if __name__ == "__main__":
    main()
