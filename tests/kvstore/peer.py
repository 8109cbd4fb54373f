"""The other process of the two-process tests: `python peer.py put|get URL NAMESPACE KEY NBYTES SEED`. Prints
`ok` (put) or `ok SAME|DIFFERENT|MISS` (get) and exits 0."""

from __future__ import annotations

import random
import sys

from deltaserve.kvstore import open_store


def payload(nbytes: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(nbytes)


def main(argv: list[str]) -> int:
    op, url, namespace, key, nbytes, seed = argv
    store = open_store(url, namespace, timeout_s=30.0)
    expected = payload(int(nbytes), int(seed))
    if op == "put":
        print("ok" if store.put(key, expected) else f"failed {store.stats}", flush=True)
    else:
        got = store.get(key)
        print("ok " + ("MISS" if got is None else "SAME" if got == expected else "DIFFERENT"), flush=True)
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
