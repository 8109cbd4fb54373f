"""The shared KV store (the L3 tier of the prefix cache): entries that several replicas and restarts see, in Redis
or the Mooncake Store, behind one `KVStore` interface that never raises on a store failure. No torch."""

from deltaserve.kvstore.config import KVStoreConfig
from deltaserve.kvstore.entry import decode, encode, fingerprint, store_key
from deltaserve.kvstore.factory import open_config, open_store
from deltaserve.kvstore.store import KVStore, KVStoreStats

__all__ = ["KVStore", "KVStoreConfig", "KVStoreStats", "decode", "encode", "fingerprint", "open_config",
           "open_store", "store_key"]
