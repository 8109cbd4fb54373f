"""`LLM.generate` with vLLM's prompt dicts: `multi_modal_data={"image": ...}` (a PIL image, an RGB array or file
bytes) and one `<|media_pad|>` per image in the prompt gives the engine's own output for the same image placed by
hand; mismatched placeholders and a model without a vision tower are errors naming the field."""

from __future__ import annotations

import numpy as np
import pytest

from deltaserve.chat.media import MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD
from deltaserve.entrypoints.llm import LLM
from deltaserve.multimodal import ImageError
from tests.helpers import prompt_ids
from tests.vision.images import encode, noise, shapes
from tests.vision.test_engine_images import (  # noqa: F401 - module fixtures
    GREEDY,
    alone,
    image_prompt,
    images,
    make_image,
    placeholder,
    vision_path,
)


@pytest.fixture(scope="module")
def llm(vision_path):  # noqa: F811
    return LLM(model=vision_path, enable_prefix_caching=False)


def test_each_image_form_gives_the_engines_output(llm, placeholder, images, alone):  # noqa: F811
    ids = image_prompt(placeholder, images["shapes"])
    one_pad = ids[:10] + [placeholder] + ids[10 + images["shapes"].num_tokens:]  # the prompt as a user writes it
    picture = shapes(112, 140)
    for form in (picture, np.asarray(picture), encode(picture, "PNG")):
        out = llm.generate({"prompt_token_ids": one_pad, "multi_modal_data": {"image": form}}, GREEDY)[0]
        assert out.outputs[0].token_ids == alone["shapes"]
        assert out.prompt_token_ids == ids
    # the full run of placeholders is taken as it is; a list of two images fills two runs in order
    assert llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [picture]}},
                        GREEDY)[0].outputs[0].token_ids == alone["shapes"]
    two = one_pad + [placeholder] + prompt_ids(1000, 3, seed=5)
    both = llm.generate({"prompt_token_ids": two, "multi_modal_data": {"image": [picture, noise(112, 140, seed=3)]}},
                        GREEDY)[0]
    assert both.prompt_token_ids.count(placeholder) == 2 * images["shapes"].num_tokens


def test_a_text_prompt_with_the_media_markers(llm, placeholder):  # noqa: F811
    text = f"{MEDIA_BEGIN}image{MEDIA_CONTENT}{MEDIA_PAD}{MEDIA_END}what is it?"
    assert llm.tokenizer.encode(text).count(placeholder) == 1
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": shapes(56, 84)}}, GREEDY)[0]
    assert out.prompt == text and out.prompt_token_ids.count(placeholder) == 6  # 4 x 6 patches -> 6 tokens
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens


def test_bad_multimodal_prompts(llm, placeholder, images, tiny_dir):  # noqa: F811
    ids = image_prompt(placeholder, images["shapes"])
    picture = shapes(112, 140)
    with pytest.raises(ValueError, match="multi_modal_data: 2 image"):
        llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [picture, picture]}}, GREEDY)
    with pytest.raises(ValueError, match="placeholder run has 3 tokens"):
        llm.generate({"prompt_token_ids": [1, placeholder, placeholder, placeholder, 2],
                      "multi_modal_data": {"image": picture}}, GREEDY)
    with pytest.raises(ImageError, match="image 0"):
        llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": b"not an image"}}, GREEDY)
    with pytest.raises(TypeError, match="prompt_token_ids"):
        llm.generate({"prompt": "a", "prompt_token_ids": [1]}, GREEDY)  # type: ignore[typeddict-item]
    with pytest.raises(ValueError, match="only 'image'"):
        llm.generate({"prompt": "a", "multi_modal_data": {"video": picture}}, GREEDY)
    text_only = LLM(model=tiny_dir("k3"))
    with pytest.raises(ValueError, match="no vision tower"):
        text_only.generate({"prompt": "a", "multi_modal_data": {"image": picture}}, GREEDY)
    assert llm.generate(ids[:5], GREEDY)[0].outputs[0].token_ids  # still generates
