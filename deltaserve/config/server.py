"""HTTP server arguments (`deltaserve serve`): address, auth, model naming and request limits."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    """How the API process listens and what it accepts. Engine sizing lives in `EngineConfig`."""

    host: str = "127.0.0.1"
    """Address to bind."""
    port: int = 8000
    """TCP port to listen on."""
    api_key: str | None = None
    """Require `Authorization: Bearer KEY` (or `x-api-key: KEY`) on /v1 routes (default: $DELTASERVE_API_KEY)."""
    served_model_name: str | None = None
    """Model name clients must send (default: the checkpoint directory's name)."""
    chat_format: str | None = None
    """Chat render program and output parsers: 'kimi_k2' or 'kimi_k3' (default: chosen from the checkpoint)."""
    max_request_bytes: int = 8 * 2**20
    """Largest accepted request body in bytes (413 above)."""
    max_n: int = 16
    """Largest accepted `n` (output sequences per request)."""
    max_queued_requests: int = 512
    """Requests waiting beyond the engine's max_num_seqs before new ones get 503 with Retry-After."""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in ("max_request_bytes", "max_n"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if self.chat_format not in (None, "kimi_k2", "kimi_k3"):
            raise ValueError(f"chat_format must be 'kimi_k2' or 'kimi_k3', got {self.chat_format!r}")
