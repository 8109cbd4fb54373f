"""Images through the engine on tiny K3 and Kimi Linear checkpoints with a vision tower: the features replace the
placeholder embeddings in any chunking, batching and preemption; the encoder cache runs the tower once per image;
prefix-cache blocks over an image are shared only with the same image."""

from __future__ import annotations

import pytest

from deltaserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from deltaserve.engine.engine_core import EngineCore
from deltaserve.models.tiny import write_tiny_checkpoint
from deltaserve.models.tiny_spec import TinySpec
from deltaserve.multimodal import ImageProcessingConfig, load_image, preprocess_image
from deltaserve.multimodal.inputs import ImageInput
from deltaserve.sampling_params import SamplingParams
from tests.helpers import prompt_ids
from tests.vision.images import encode, noise, shapes

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BLOCK = 16


# CI time: Kimi Linear's image path through the engine runs in CI by test_llm_images.py; all of this module on it
# under -m slow.
@pytest.fixture(scope="module", params=["kimi_k3", pytest.param("kimi_linear", marks=pytest.mark.slow)])
def vision_path(request, tmp_path_factory):
    spec = TinySpec(arch=request.param, seed=4, vision=True)
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp(f"{request.param}-vision-engine"), spec))


@pytest.fixture(scope="module")
def placeholder(vision_path):
    vision = ModelConfig.from_pretrained(vision_path).vision
    assert vision is not None
    return vision.media_placeholder_token_id


@pytest.fixture(scope="module")
def make_image(vision_path):
    vision = ModelConfig.from_pretrained(vision_path).vision
    assert vision is not None
    config = ImageProcessingConfig.for_vision(vision)

    def make(picture, offset: int) -> ImageInput:
        return ImageInput.from_processed(preprocess_image(load_image(encode(picture, "PNG")), config), offset)
    return make


def core(path: str, *, budget: int = 512, prefix: bool = True, **cache: object) -> EngineCore:
    return EngineCore(EngineConfig(model=path, cache=CacheConfig(block_size=BLOCK, enable_prefix_caching=prefix,
                                                                 **cache),  # type: ignore[arg-type]
                                   scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8)))


def run(engine: EngineCore, requests: dict[str, tuple[list[int], tuple[ImageInput, ...]]]) -> dict[str, list[int]]:
    for rid, (ids, images) in requests.items():
        engine.add_request(rid, ids, GREEDY, images=images)
    out: dict[str, list[int]] = {rid: [] for rid in requests}
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.error is None, o.error
            out[o.request_id] += o.new_token_ids
    return out


def image_prompt(placeholder: int, image: ImageInput, seed: int = 1) -> list[int]:
    """Text, the image's placeholders (at `image.offset`), text."""
    return prompt_ids(1000, image.offset, seed=seed) + [placeholder] * image.num_tokens + prompt_ids(1000, 7, seed=2)


@pytest.fixture(scope="module")
def images(make_image):
    # 112 x 140 pixels -> 8 x 10 patches of 14 -> 20 tokens; at offset 10 they cover positions 10..29 (blocks 0, 1).
    return {"shapes": make_image(shapes(112, 140), 10), "noise": make_image(noise(112, 140, seed=3), 10)}


@pytest.fixture(scope="module")
def alone(vision_path, placeholder, images):
    """Each image prompt run alone, unchunked, without prefix caching: the reference outputs."""
    engine = core(vision_path, prefix=False)
    return {name: run(engine, {name: (image_prompt(placeholder, im), (im,))})[name] for name, im in images.items()}


def test_the_image_changes_the_output_and_text_only_is_not_the_image(vision_path, placeholder, images, alone):
    """Different images give different greedy continuations of the same tokens, and the placeholders without an
    image (their token embedding) give a third: the features are really used."""
    text_only = run(core(vision_path, prefix=False), {"t": (image_prompt(placeholder, images["shapes"]), ())})["t"]
    assert alone["shapes"] != alone["noise"]
    assert text_only not in (alone["shapes"], alone["noise"])


@pytest.mark.parametrize("budget", [7, pytest.param(16, marks=pytest.mark.slow), 23])  # CI time
def test_chunked_prefill_that_splits_the_image_batched_with_text(vision_path, placeholder, images, alone, budget):
    """A small token budget splits the image over several steps (chunks starting and ending inside it); text-only
    requests run in the same steps; outputs equal the unchunked, unbatched run."""
    engine = core(vision_path, budget=budget, prefix=False)
    requests: dict[str, tuple[list[int], tuple[ImageInput, ...]]] = {
        name: (image_prompt(placeholder, im), (im,)) for name, im in images.items()}
    requests["text"] = (prompt_ids(1000, 30, seed=9), ())
    got = run(engine, requests)
    assert {k: got[k] for k in alone} == alone
    assert got["text"] == run(core(vision_path, prefix=False), {"text": requests["text"]})["text"]


def test_preemption_recomputes_the_image(vision_path, placeholder, images, alone):
    """With too few blocks for both, one image request is preempted and recomputed: same outputs."""
    engine = core(vision_path, budget=16, num_blocks=4, num_state_slots=2)
    got = run(engine, {name: (image_prompt(placeholder, im), (im,)) for name, im in images.items()})
    assert engine.scheduler.num_preemptions > 0
    assert got == alone


def test_encoder_cache_runs_the_tower_once_per_image(vision_path, placeholder, images, alone):
    """Chunks of one image and later requests with the same image reuse its features."""
    engine = core(vision_path, budget=7, prefix=False)
    embedder = engine.executor.worker.runner.images  # type: ignore[attr-defined]
    im = images["shapes"]
    for rid in ("a", "b"):
        assert run(engine, {rid: (image_prompt(placeholder, im), (im,))})[rid] == alone["shapes"]
    assert embedder.images_encoded == 1 and embedder.encoder_calls == 1
    assert embedder.cache.hits > 0
    stats = engine.get_stats()  # the engine's counters (metrics) see the same
    assert stats.images_encoded == 1 and stats.encoder_cache_hits == embedder.cache.hits
    assert stats.encoder_seconds > 0


def test_without_the_encoder_cache_the_tower_runs_per_chunk(vision_path, placeholder, images, alone):
    """encoder_cache_memory=0: every chunk over the image runs the tower again; the output is the same."""
    engine = core(vision_path, budget=7, prefix=False, encoder_cache_memory=0)
    im = images["shapes"]
    assert run(engine, {"a": (image_prompt(placeholder, im), (im,))})["a"] == alone["shapes"]
    stats = engine.get_stats()
    # 20 placeholders at offset 10 in chunks of 7 tokens: chunks 1..4 (tokens 7..34) cover them
    assert stats.images_encoded == 4 and stats.encoder_cache_hits == 0


def test_prefix_cache_separates_images_and_hits_the_same_image(vision_path, placeholder, images, alone):
    """A prompt that differs only in its image shares no block past the image start; the same image again hits."""
    engine = core(vision_path)
    first = image_prompt(placeholder, images["shapes"])
    assert run(engine, {"a": (first, (images["shapes"],))})["a"] == alone["shapes"]
    results = {}
    for rid, name in (("b", "noise"), ("c", "shapes")):
        engine.add_request(rid, first, GREEDY, images=(images[name],))
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            for o in engine.step():
                tokens += o.new_token_ids
                if o.finish_reason is not None:
                    results[rid] = (tokens, o.num_cached_tokens)
    # The image starts at position 10, inside block 0: a different image may not hit any block.
    assert results["b"] == (alone["noise"], 0)
    # The same image: the finished request's state and blocks cover the prompt (all but its last token).
    assert results["c"][0] == alone["shapes"]
    assert results["c"][1] >= images["shapes"].end


def test_bad_image_records_are_refused(vision_path, placeholder, images, tiny_dir):
    """Images over non-placeholder tokens, outside the prompt, and images for a model without a vision tower are
    ValueErrors at add_request."""
    engine = core(vision_path)
    im = images["shapes"]
    with pytest.raises(ValueError, match="placeholder"):
        engine.add_request("x", prompt_ids(1000, 40, seed=5), GREEDY, images=(im,))
    with pytest.raises(ValueError, match="inside the prompt"):
        engine.add_request("y", [placeholder] * 12, GREEDY, images=(im,))
    text_model = EngineCore(EngineConfig(model=str(tiny_dir("base"))))
    with pytest.raises(ValueError, match="no vision tower"):
        text_model.add_request("z", image_prompt(placeholder, im), GREEDY, images=(im,))


def test_a_prefix_hit_inside_the_image_resumes_mid_image(vision_path, placeholder, images):
    """A checkpoint at position 16 lies inside the image (10..29): a prompt with the same text and image but a
    different ending hits there, its first chunk starts at image row 6, and its output equals the uncached run."""
    im = images["shapes"]
    first = image_prompt(placeholder, im)
    second = first[:im.end] + prompt_ids(1000, 9, seed=77)
    engine = core(vision_path, state_checkpoint_interval=BLOCK)
    run(engine, {"a": (first, (im,))})
    engine.add_request("b", second, GREEDY, images=(im,))
    tokens: list[int] = []
    cached = -1
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens += o.new_token_ids
            if o.finish_reason is not None:
                cached = o.num_cached_tokens
    assert im.offset < cached < im.end, cached
    assert tokens == run(core(vision_path, prefix=False), {"b": (second, (im,))})["b"]
