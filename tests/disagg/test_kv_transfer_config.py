"""`--kv-transfer-config`: vLLM's keys and connector names, one-line errors naming the field, and what a role
implies for the engine config."""

from __future__ import annotations

import pytest

from deltaserve.config import CacheConfig, EngineConfig, KVTransferConfig


def test_vllm_names_and_defaults():
    cfg = KVTransferConfig.from_json('{"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_rank": 0,'
                                     ' "kv_parallel_size": 2}')  # vLLM keys deltaserve has no use for are ignored
    assert cfg.transport == "nixl" and cfg.is_producer and not cfg.is_consumer
    both = KVTransferConfig.from_json({})
    assert both.transport == "shm" and both.is_producer and both.is_consumer
    assert KVTransferConfig.from_json({"kv_connector": "MooncakeConnector"}).transport == "mooncake"


@pytest.mark.parametrize(("value", "field"), [
    ('{"kv_role": "prefill"}', "kv_role"), ('{"kv_connector": "P2pNcclConnector"}', "kv_connector"),
    ('{"kv_connector": 3}', "kv_connector"), ('{"kv_port": 70000}', "kv_port"),
    ('{"transfer_timeout_s": 0}', "transfer_timeout_s"), ('{"kv_buffer_size": "big"}', "kv_buffer_size"),
    ('{"kv_rolee": "kv_both"}', "unknown field"), ("[1]", "must be a JSON object"), ("{", "not valid JSON"),
])
def test_errors_name_the_field(value, field):
    with pytest.raises(ValueError, match=field):
        KVTransferConfig.from_json(value)


def test_roles_and_the_engine_config():
    consumer = EngineConfig(model="m", kv_transfer_config=KVTransferConfig(kv_role="kv_consumer"))
    assert consumer.cache.host_cache_memory == "512MiB"  # fetched caches land in the host tier
    sized = EngineConfig(model="m", cache=CacheConfig(host_cache_memory="1GiB"),
                         kv_transfer_config=KVTransferConfig(kv_role="kv_consumer"))
    assert sized.cache.host_cache_memory == "1GiB"
    producer = EngineConfig(model="m", kv_transfer_config=KVTransferConfig(kv_role="kv_producer"))
    assert producer.cache.host_cache_memory is None
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(model="m", cache=CacheConfig(enable_prefix_caching=False),
                     kv_transfer_config=KVTransferConfig(kv_role="kv_consumer"))
