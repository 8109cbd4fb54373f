"""The only place deltaserve reads environment variables."""

from __future__ import annotations

import os


def api_key() -> str | None:
    """`DELTASERVE_API_KEY`: the bearer key the server requires when `--api-key` is not given."""
    return os.environ.get("DELTASERVE_API_KEY") or None
