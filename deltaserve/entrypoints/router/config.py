"""`RouterConfig`: the instances a router fronts, where it listens, and `RouterTimeouts`, how long it waits on
its instances (the `deltaserve router` options; their help comes from these docstrings)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterTimeouts:
    """How long the router waits on its instances, and how often it checks them."""

    health_interval_s: float = 2.0
    """Seconds between two GET /health of every instance; a failing instance is skipped until it answers 200."""
    health_timeout_s: float = 2.0
    """An instance whose /health does not answer within this time fails the check."""
    connect_timeout_s: float = 5.0
    """Longest wait for a connection to an instance (then: another instance, or the fallback)."""
    prefill_timeout_s: float = 300.0
    """Longest wait for a prefill instance's answer (one generated token: the prompt's whole prefill)."""
    decode_timeout_s: float = 600.0
    """Longest wait for the next bytes of a decode instance: its response headers, a non-streamed body (all of the
    generation), the next stream event. A frozen instance is cut off sooner by its failed health checks."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"router: --{f.name.replace('_', '-')} must be a number > 0, got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterConfig:
    """What `deltaserve router` serves."""

    prefill_urls: tuple[str, ...] = ()
    """Base URLs of the prefill instances (`http://host:port`); none: every request is prefilled on its decode
    instance."""
    decode_urls: tuple[str, ...] = ()
    """Base URLs of the decode instances; at least one."""
    host: str = "127.0.0.1"
    """Address the router listens on."""
    port: int = 8000
    """Port the router listens on."""
    timeouts: RouterTimeouts = field(default_factory=RouterTimeouts)

    def __post_init__(self) -> None:
        if not self.decode_urls:
            raise ValueError("router: at least one --decode URL is needed")
        for url in (*self.prefill_urls, *self.decode_urls):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"router: instance URL {url!r} must start with http:// or https://")
        # One spelling per instance: metrics labels and the health log name it by this URL.
        object.__setattr__(self, "prefill_urls", tuple(u.rstrip("/") for u in self.prefill_urls))
        object.__setattr__(self, "decode_urls", tuple(u.rstrip("/") for u in self.decode_urls))
