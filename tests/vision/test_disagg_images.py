"""Prefill/decode disaggregation of an image prompt: the prefill side encodes the image and hands over the cache
over it; the decode side's greedy output equals a unified engine's, and a transfer made for another image (same
tokens, other pixels) is refused by its digest and computed locally."""

from __future__ import annotations

from deltaserve.config import CacheConfig, EngineConfig, KVTransferConfig, SchedulerConfig
from deltaserve.engine.engine_core import EngineCore
from tests.vision.test_engine_images import (  # noqa: F401 - module fixtures
    GREEDY,
    image_prompt,
    images,
    make_image,
    placeholder,
    vision_path,
)


def engine(path: str, role: str | None) -> EngineCore:
    kv = None if role is None else KVTransferConfig(kv_connector="tcp", kv_role=role)
    return EngineCore(EngineConfig(model=path, cache=CacheConfig(block_size=16, host_cache_memory="16MiB"),
                                   scheduler=SchedulerConfig(max_num_batched_tokens=16), kv_transfer_config=kv))


def run(core: EngineCore, rid: str, prompt, image, params=None):
    core.add_request(rid, prompt, GREEDY, images=(image,), kv_transfer_params=params)
    ids, last = [], None
    while core.has_unfinished_requests():
        for out in core.step():
            assert out.error is None, out.error
            ids += out.new_token_ids
            last = out
    return ids, last.kv_transfer_params, last.num_cached_tokens


def test_image_prompt_disaggregated_equals_unified(vision_path, placeholder, images):  # noqa: F811
    cores = engine(vision_path, "kv_producer"), engine(vision_path, "kv_consumer"), engine(vision_path, None)
    try:
        shapes, noise = images["shapes"], images["noise"]
        prompt = image_prompt(placeholder, shapes)
        want, _, _ = run(cores[2], "u", prompt, shapes)
        _, params, _ = run(cores[0], "p", prompt, shapes, {"do_remote_decode": True})
        got, _, cached = run(cores[1], "d", prompt, shapes, params)
        assert got == want and cached == len(prompt) - 1
        # The same tokens with another image: the shapes image's transfer does not fit it.
        other, _, _ = run(cores[2], "u2", prompt, noise)
        assert other != want
        got, _, cached = run(cores[1], "d2", prompt, noise, params)
        assert got == other and cached == 0
        assert cores[1].get_stats().kv_transfer_fallbacks == 1
    finally:
        for core in cores:
            core.shutdown()
