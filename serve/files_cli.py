"""The flags of `jaxinfer serve` for its Files and Batches API (/v1/files, /v1/batches)."""

from __future__ import annotations

import argparse

from serve.files_config import FilesConfig, default_data_dir


def add_files_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("files and batches")
    g.add_argument("--data-dir", default=default_data_dir(),
                   help="uploaded files, batch results and their database; they survive a "
                        "restart, and unfinished batches resume (default: %(default)s)")
    g.add_argument("--max-stored-bytes", type=int, default=FilesConfig.max_stored_bytes,
                   help="all stored files together; an upload past it gets 413 "
                        "(default: %(default)s)")
    g.add_argument("--max-active-batches", type=int, default=FilesConfig.max_active_batches,
                   help="batches running at once; one more gets 429 (default: %(default)s)")
    g.add_argument("--batch-max-in-flight", type=int, default=FilesConfig.max_in_flight,
                   help="lines of one batch in the engine at once (default: %(default)s)")
    g.add_argument("--batch-priority", type=int, default=FilesConfig.batch_priority,
                   help="the `priority` of batch lines under --scheduling-policy priority "
                        "(lower runs first; interactive requests default to 0) "
                        "(default: %(default)s)")
    g.add_argument("--batch-expiry-s", type=int, default=FilesConfig.expiry_s,
                   help="seconds a batch has from its creation; then its unanswered lines fail "
                        "with code batch_expired and it ends expired (default: %(default)s)")
    g.add_argument("--no-files-api", action="store_true", help="no /v1/files and /v1/batches")


def files_config(args: argparse.Namespace) -> FilesConfig | None:
    if args.no_files_api:
        return None
    return FilesConfig(data_dir=args.data_dir, max_stored_bytes=args.max_stored_bytes,
                       max_active_batches=args.max_active_batches,
                       max_in_flight=args.batch_max_in_flight,
                       batch_priority=args.batch_priority, expiry_s=args.batch_expiry_s)
