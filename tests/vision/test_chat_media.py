"""Images in chat prompts: both Kimi formats render `<|media_begin|>image<|media_content|>`, one `<|media_pad|>` per
image token and `<|media_end|>` where the image sits in the message text; text-only messages render as before."""

from __future__ import annotations

import pytest

from deltaserve.chat import get_chat_format
from deltaserve.chat.kimi_k2 import KimiK2Format
from deltaserve.chat.media import MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD, MEDIA_TOKENS, ImageSlot
from deltaserve.chat.messages import ChatMessage
from deltaserve.text import tiny_tokenizer
from deltaserve.text.tokenizer import Tokenizer


def _k25_tokenizer(out) -> Tokenizer:
    """A tiny K2-flavour tokenizer with K2.5's media tokens (the tiny K2 set, like Kimi Linear, has none)."""
    specials = (*tiny_tokenizer.TINY_SPECIAL_TOKENS[:-2], *MEDIA_TOKENS, "[UNK]", "[PAD]")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(tiny_tokenizer.FLAVORS, "k25", specials)
        mp.setitem(tiny_tokenizer._CONFIG_EOS, "k25", "<|im_end|>")
        tiny_tokenizer.write_tiny_tokenizer(out, 600, flavor="k25")
    return Tokenizer.from_pretrained(out)


@pytest.fixture(scope="module", params=["kimi_k2", "kimi_k3"])
def fmt(request, tiny_dir, tmp_path_factory):
    if request.param == "kimi_k2":
        return KimiK2Format(_k25_tokenizer(tmp_path_factory.mktemp("k25-tokenizer")))
    path = tiny_dir("k3")
    return get_chat_format(path, Tokenizer.from_pretrained(path))


def test_a_tokenizer_without_media_tokens_refuses_images(tiny_dir):
    path = tiny_dir("base")  # Kimi Linear: no media tokens
    fmt = get_chat_format(path, Tokenizer.from_pretrained(path))
    with pytest.raises(ValueError, match="cannot take images"):
        fmt.render([ChatMessage(role="user", content="x", images=(ImageSlot(0, 2),))], thinking=False)


def _expected_media(fmt, n: int) -> list[int]:
    special = fmt.tokenizer.special_tokens
    return [special[MEDIA_BEGIN], *fmt.tokenizer.encode("image"), special[MEDIA_CONTENT], *[special[MEDIA_PAD]] * n,
            special[MEDIA_END]]


def _find(ids: list[int], part: list[int]) -> int:
    for i in range(len(ids) - len(part) + 1):
        if ids[i:i + len(part)] == part:
            return i
    return -1


@pytest.mark.parametrize("position", [0, 5, 11])
def test_image_markers_sit_where_the_image_is(fmt, position):
    text = "hello world"
    ids = fmt.render([ChatMessage(role="user", content=text, images=(ImageSlot(position, 3),))], thinking=False)
    media = _expected_media(fmt, 3)
    at = _find(ids, media)
    assert at >= 0
    pad = fmt.tokenizer.special_tokens[MEDIA_PAD]
    assert ids.count(pad) == 3
    before, after = text[:position], text[position:]
    if before:
        assert ids[at - len(fmt.tokenizer.encode(before)):at] == fmt.tokenizer.encode(before)
    if after:
        assert ids[at + len(media):at + len(media) + len(fmt.tokenizer.encode(after))] == fmt.tokenizer.encode(after)
    # Without the image: the same prompt minus the media run.
    plain = fmt.render([ChatMessage(role="user", content=text)], thinking=False)
    assert len(ids) - len(media) <= len(plain) + 1  # the text may tokenise differently once cut at the image


def test_two_images_and_text_only_prompts_unchanged(fmt):
    message = ChatMessage(role="user", content="ab", images=(ImageSlot(1, 2), ImageSlot(2, 4)))
    ids = fmt.render([message], thinking=False)
    assert ids.count(fmt.tokenizer.special_tokens[MEDIA_PAD]) == 6
    assert _find(ids, _expected_media(fmt, 2)) < _find(ids, _expected_media(fmt, 4))


def test_images_only_in_user_and_tool_messages_and_in_order():
    with pytest.raises(ValueError, match="only user and tool"):
        ChatMessage(role="assistant", content="x", images=(ImageSlot(0, 1),))
    with pytest.raises(ValueError, match="in order"):
        ChatMessage(role="user", content="abc", images=(ImageSlot(2, 1), ImageSlot(1, 1)))
    with pytest.raises(ValueError, match="in order"):
        ChatMessage(role="user", content="abc", images=(ImageSlot(4, 1),))
