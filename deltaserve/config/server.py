"""HTTP server arguments (`deltaserve serve`): address, auth, model naming and request limits."""

from __future__ import annotations

from dataclasses import dataclass, field

from deltaserve.config.media import MediaConfig


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    """How the API process listens and what it accepts. Engine sizing lives in `EngineConfig`."""

    host: str = "127.0.0.1"
    """Address to bind."""
    port: int = 8000
    """TCP port to listen on."""
    api_key: str | None = None
    """Require this key, sent as `Authorization: Bearer KEY` or `x-api-key: KEY`, on every /v1 route, /tokenize,
    /detokenize and /reset_prefix_cache (not /health, /version or /metrics); default: $DELTASERVE_API_KEY."""
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
    max_stop_sequences: int = 16
    """Most stop strings per request (`stop`, Anthropic's `stop_sequences`; 400 above). OpenAI allows 4 on chat,
    vLLM has no cap; each string is matched against every sequence's new text."""
    max_unread_stream_tokens: int = 8192
    """Most generated tokens a streaming response may hold for a client that does not read them: past it the
    request is aborted (logged) instead of buffering without bound."""
    health_timeout_s: float = 10.0
    """/health answers 503 when the engine process sent no heartbeat for this long. Its heartbeat thread beats
    every 0.5 s whatever the step loop does, so a long step is not a missed beat: only a stopped or frozen
    process (or one starved of CPU for this long) is."""
    request_timeout_s: float | None = None
    """Abort a generation request still running this many seconds after it arrived and free its cache (an error
    response, or an error event in a stream); default: no deadline."""
    restart_engine: bool = False
    """When the engine process dies, fail the requests in flight and start a new engine process; without it the
    server fails them and exits with status 1 (for a supervisor to restart it)."""
    shutdown_timeout_s: float = 30.0
    """On SIGTERM: new requests get 503 with Retry-After while the ones in flight get this long to finish; those
    still running then are aborted, and the server exits with status 0."""
    header_timeout_s: float = 10.0
    """Close a connection (after a 408) whose request headers have not all arrived this long after its first
    byte (or after it opened)."""
    body_timeout_s: float = 60.0
    """Answer 408 to a request whose body has not all arrived this long after its headers."""
    media: MediaConfig = field(default_factory=MediaConfig)
    """Image sources and limits (their own flags: --allowed-media-domains, --limit-mm-per-prompt, ...)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in ("max_request_bytes", "max_n", "max_stop_sequences", "max_unread_stream_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("health_timeout_s", "shutdown_timeout_s", "header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if self.chat_format not in (None, "kimi_k2", "kimi_k3"):
            raise ValueError(f"chat_format must be 'kimi_k2' or 'kimi_k3', got {self.chat_format!r}")
