"""`KVTransferConfig`: prefill/decode disaggregation (vLLM's `--kv-transfer-config` JSON and key names).

Each error is one line naming its field (`kv_transfer_config.kv_role must be ...`).
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field, fields
from typing import Any

from deltaserve.config.fields import check_known_fields, parse_json_object

ROLES = ("kv_producer", "kv_consumer", "kv_both")
CONNECTORS = {
    # our names, and vLLM's connector class names for the same transports
    "shm": "shm", "tcp": "tcp", "nixl": "nixl", "mooncake": "mooncake",
    "DeltaConnector": "shm", "SharedMemoryConnector": "shm", "TcpConnector": "tcp",
    "NixlConnector": "nixl", "MooncakeConnector": "mooncake",
}
"""kv_connector value -> transport. 'shm' (the default) moves payloads through shared memory when both instances
are on one host and over TCP otherwise; 'tcp' always over TCP; 'nixl' and 'mooncake' use those libraries."""


@dataclass(frozen=True, slots=True, kw_only=True)
class KVTransferConfig:
    """This instance's part in a disaggregated deployment: a prefill instance (`kv_producer`) computes prompts and
    hands their KV blocks and KDA state to a decode instance (`kv_consumer`), which decodes; `kv_both` does
    either, per request (the request's `kv_transfer_params` say which)."""

    kv_connector: str = "shm"
    """Transport: 'shm' (shared memory on one host, TCP between hosts; nothing to install), 'tcp', 'nixl' or
    'mooncake' (optional libraries); vLLM's names 'NixlConnector', 'MooncakeConnector' are accepted."""
    kv_role: str = "kv_both"
    """'kv_producer' (prefill), 'kv_consumer' (decode) or 'kv_both'."""
    kv_ip: str = "127.0.0.1"
    """Address the producer's transfer servers listen on and advertise (one per rank, on free ports)."""
    kv_port: int = 0
    """First port of the transfer servers (rank r uses kv_port + r); 0: any free port."""
    kv_buffer_size: float = 4e9
    """Bytes of payloads a producer rank holds for consumers that have not fetched them yet (oldest dropped past
    it: their decode instances recompute)."""
    transfer_timeout_s: float = 30.0
    """A consumer's fetch that takes longer fails (and the decode instance recomputes the prompt)."""
    transfer_ttl_s: float = 120.0
    """A producer drops a payload not fetched within this time."""
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    """Options of the transport (see its module)."""

    def __post_init__(self) -> None:
        if self.kv_connector not in CONNECTORS:
            raise ValueError(_err("kv_connector", f"must be one of {', '.join(map(repr, CONNECTORS))}",
                                  self.kv_connector))
        if self.kv_role not in ROLES:
            raise ValueError(_err("kv_role", f"must be one of {', '.join(map(repr, ROLES))}", self.kv_role))
        if not isinstance(self.kv_ip, str) or not self.kv_ip:
            raise ValueError(_err("kv_ip", "must be a host name or address", self.kv_ip))
        if not isinstance(self.kv_port, int) or isinstance(self.kv_port, bool) or not 0 <= self.kv_port < 65536:
            raise ValueError(_err("kv_port", "must be an integer port 0..65535", self.kv_port))
        for name in ("kv_buffer_size", "transfer_timeout_s", "transfer_ttl_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(_err(name, "must be a number > 0", value))
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError(_err("kv_connector_extra_config", "must be a JSON object", self.kv_connector_extra_config))

    @property
    def transport(self) -> str:
        """The transport's name: 'shm', 'tcp', 'nixl' or 'mooncake'."""
        return CONNECTORS[self.kv_connector]

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_json(cls, value: str | dict[str, Any] | KVTransferConfig) -> KVTransferConfig:
        """Parse a JSON object (text or a decoded dict), as given to `--kv-transfer-config`. Unknown keys, wrong
        types and bad values raise a one-line ValueError naming the field."""
        if isinstance(value, KVTransferConfig):
            return value
        value = parse_json_object(value, "kv_transfer_config")
        known = [f.name for f in fields(cls)]
        # vLLM keys we accept and ignore: they size or name things we do not have.
        check_known_fields(value, known, "kv_transfer_config", frozenset(
            {"kv_rank", "kv_parallel_size", "engine_id", "kv_buffer_device", "kv_load_failure_policy"}))
        if "kv_connector" in value and not isinstance(value["kv_connector"], str):
            raise ValueError(_err("kv_connector", "must be a string", value["kv_connector"]))
        return cls(**{k: v for k, v in value.items() if k in known})


def _err(name: str, rule: str, value: Any) -> str:
    return f"kv_transfer_config.{name} {rule}, got {value!r:.60}"


def prompt_digest(token_ids: list[int]) -> str:
    """A digest of prompt token ids: the decode instance checks that the transferred cache is for its own prompt
    (two instances may render or tokenise a request differently)."""
    return hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=16).hexdigest()  # 64-bit: image keys


@dataclass(frozen=True, slots=True, kw_only=True)
class RemotePrefill:
    """A decode instance's request whose prompt a prefill instance computed: where to fetch the cache (the
    `kv_transfer_params` the prefill instance returned, which the router passes on)."""

    transfer_id: str
    addresses: tuple[str, ...]
    """The producer's transfer server per tensor-parallel rank."""
    num_tokens: int
    """Prompt tokens whose KV and state were computed (all but the last: the decode instance computes that one and
    samples the first output token, so the handoff token is fed exactly once)."""
    prompt_digest: str
    """`prompt_digest` of those tokens."""

    def as_params(self) -> dict[str, Any]:
        """The `kv_transfer_params` object a prefill instance returns."""
        return {"do_remote_prefill": True, "transfer_id": self.transfer_id, "remote_addresses": list(self.addresses),
                "num_tokens": self.num_tokens, "prompt_digest": self.prompt_digest}

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> RemotePrefill:
        """Parse `kv_transfer_params` with `do_remote_prefill`; ValueError naming the bad field."""
        tid, addresses, n, digest = (params.get(k) for k in ("transfer_id", "remote_addresses", "num_tokens",
                                                             "prompt_digest"))
        if not isinstance(tid, str) or not tid:
            raise ValueError(f"kv_transfer_params.transfer_id must be a non-empty string, got {tid!r:.60}")
        if (not isinstance(addresses, list) or not addresses
                or not all(isinstance(a, str) and "://" in a for a in addresses)):
            raise ValueError("kv_transfer_params.remote_addresses must be a non-empty list of 'scheme://...' "
                             f"strings, got {addresses!r:.80}")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"kv_transfer_params.num_tokens must be an integer >= 1, got {n!r:.60}")
        if not isinstance(digest, str) or not digest:
            raise ValueError(f"kv_transfer_params.prompt_digest must be a non-empty string, got {digest!r:.60}")
        return cls(transfer_id=tid, addresses=tuple(addresses), num_tokens=n, prompt_digest=digest)


def parse_transfer_request(params: Any) -> tuple[bool, RemotePrefill | None]:
    """A request's `kv_transfer_params`: (do_remote_decode, the remote prefill to fetch). ValueError naming the
    field for a malformed object; None and unknown flags are no transfer."""
    if params is None:
        return False, None
    if not isinstance(params, dict):
        raise ValueError(f"kv_transfer_params must be a JSON object, got {params!r:.60}")
    for flag in ("do_remote_decode", "do_remote_prefill"):
        if not isinstance(params.get(flag, False), bool):
            raise ValueError(f"kv_transfer_params.{flag} must be a boolean, got {params[flag]!r:.60}")
    if params.get("do_remote_decode") and params.get("do_remote_prefill"):
        raise ValueError("kv_transfer_params: do_remote_decode and do_remote_prefill exclude each other")
    remote = RemotePrefill.from_params(params) if params.get("do_remote_prefill") else None
    return bool(params.get("do_remote_decode")), remote
