"""The OpenAI-compatible HTTP server: `create_app` (serve/app.py), `jaxinfer serve` (serve/cli.py),
and batch jobs answered by the same routes in process (serve/batch.py)."""

DEFAULT_MAX_BODY_BYTES = 8 * 2**20  # request bodies above this get 413
