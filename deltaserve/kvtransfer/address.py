"""Transfer addresses: `scheme://host:port`, the scheme naming the producer's transport (`tcp`, `shm+tcp`,
`nixl+tcp`, `mooncake+tcp`) and host:port its TCP control server, which every transport runs."""

from __future__ import annotations

import functools
import socket
from dataclasses import dataclass

SCHEMES = ("tcp", "shm+tcp", "nixl+tcp", "mooncake+tcp")


@dataclass(frozen=True, slots=True)
class Address:
    """A parsed transfer address."""

    scheme: str
    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"


def parse_address(address: str) -> Address:
    """`scheme://host:port` (IPv6 hosts in brackets); ValueError naming the address otherwise."""
    scheme, sep, rest = address.partition("://")
    host, colon, port = rest.rpartition(":")
    if not sep or scheme not in SCHEMES or not colon or not port.isdigit() or not host:
        raise ValueError(f"transfer address must be one of {'|'.join(SCHEMES)}://host:port, got {address!r:.80}")
    return Address(scheme, host.strip("[]"), int(port))


@functools.lru_cache(maxsize=64)
def is_local_host(host: str) -> bool:
    """Whether `host` names this machine: it resolves to an address this machine can bind (loopback or one of its
    interfaces). Shared memory needs both sides on one host."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((sockaddr[0], 0))  # succeeds only for an address of a local interface
                return True
            except OSError:
                continue
    return False
