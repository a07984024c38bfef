"""The OpenAI-compatible HTTP server: `create_app` (serve/app.py) and `jaxinfer serve` (serve/cli.py)."""

DEFAULT_MAX_BODY_BYTES = 8 * 2**20  # request bodies above this get 413
