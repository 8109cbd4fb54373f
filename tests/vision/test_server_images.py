"""Images through the real server on a tiny K3 checkpoint with a vision tower, with the official `openai` and
`anthropic` SDKs: an image request answers (usage counts the image tokens), from a data URL, a loopback http server
or the allowed local directory alike; every bad image or URL, and one image too many, is a 400 naming its content
part, and the server keeps serving; a model without a vision tower refuses images with a 400."""

from __future__ import annotations

import base64
import struct
import zlib
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from deltaserve.models.tiny_k3 import write_tiny_k3_checkpoint
from deltaserve.models.tiny_spec import TinySpec
from tests.entrypoints.server_fixture import API_KEY, start_server, stop_server
from tests.vision.images import encode, noise, shapes
from tests.vision.media_server import media_server

PNG = encode(shapes(56, 84), "PNG")  # 4 x 6 patches of 14 -> 6 image tokens
JPEG = encode(noise(60, 40, seed=2), "JPEG")


def _png_with_size(png: bytes, width: int, height: int) -> bytes:
    """`png` with its IHDR saying width x height (the chunk's CRC recomputed, so only the size is wrong)."""
    ihdr = png[12:16] + struct.pack(">II", width, height) + png[24:29]
    return png[:8] + png[8:12] + ihdr + struct.pack(">I", zlib.crc32(ihdr)) + png[33:]


BAD = {
    "not_an_image": base64.b64encode(b"hello, this is text").decode(),
    "truncated": base64.b64encode(PNG[: len(PNG) // 2]).decode(),
    "too_many_pixels": base64.b64encode(_png_with_size(PNG, 20000, 20000)).decode(),
    "zero_size": base64.b64encode(_png_with_size(PNG, 0, 7)).decode(),
    "bad_base64": "%%%not base64%%%",
}


def _data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory) -> Path:
    """The server's --allowed-local-media-path, holding PNG as cat.png."""
    root = tmp_path_factory.mktemp("media")
    (root / "cat.png").write_bytes(PNG)
    return root


@pytest.fixture(scope="module")
def images_http():
    with media_server(PNG) as live:
        yield live


@pytest.fixture(scope="module")
def server(tmp_path_factory, media_dir):
    path = write_tiny_k3_checkpoint(tmp_path_factory.mktemp("k3-vision-ckpt"), TinySpec(arch="kimi_k3", seed=4),
                                    vision=True)
    live = start_server(path, tmp_path_factory.mktemp("k3-vision-server"), "--max-model-len", "512",
                        "--allowed-media-domains", "127.0.0.1", "--allowed-local-media-path", str(media_dir),
                        "--limit-mm-per-prompt", '{"image": 2}')
    yield live
    stop_server(live)


@pytest.fixture(scope="module")
def oa(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def an(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)


def _openai_image(client: openai.OpenAI, url: str, max_tokens: int = 4):
    return client.chat.completions.create(model="tiny", max_tokens=max_tokens, temperature=0.0, messages=[
        {"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                     {"type": "image_url", "image_url": {"url": url}}]}])


def _anthropic_image(client: anthropic.Anthropic, source: dict, max_tokens: int = 4):
    # Any: bad sources are the point of some tests, and the SDK's TypedDicts refuse them.
    messages: Any = [
        {"role": "user", "content": [{"type": "image", "source": source}, {"type": "text", "text": "describe"}]}]
    return client.messages.create(model="tiny", max_tokens=max_tokens, messages=messages,
                                  extra_body={"temperature": 0.0})  # this SDK version has no temperature argument


def _text_tokens(server, messages: list[dict]) -> int:
    resp = httpx.post(f"{server.url}/tokenize", headers=server.headers(), timeout=60,
                      json={"model": "tiny", "messages": messages})
    assert resp.status_code == 200, resp.text
    return len(resp.json()["tokens"])


def test_openai_image_request_answers_and_counts_image_tokens(server, oa):
    text = [{"type": "text", "text": "what is this?"}]
    resp = _openai_image(oa, _data_url(PNG))
    assert resp.choices[0].finish_reason == "length" and resp.usage is not None
    with_image = _text_tokens(server, [{"role": "user", "content": [
        *text, {"type": "image_url", "image_url": {"url": _data_url(PNG)}}]}])
    assert resp.usage.prompt_tokens == with_image
    # The image adds its 6 placeholders and the 4 marker tokens around them (and "image", one token or more).
    assert with_image - _text_tokens(server, [{"role": "user", "content": text}]) >= 6 + 4
    assert _openai_image(oa, _data_url(JPEG, "jpeg")).choices[0].message is not None
    # the vision metrics: each image encoded once (a repeat is an encoder-cache hit, or a prefix-cache hit)
    assert server.metric("images_encoded_total") >= 2
    assert server.metric("encoder_cache_queries_total") >= server.metric("encoder_cache_hits_total") + 2
    assert server.metric("encoder_seconds_total") > 0


def test_openai_streams_an_image_request(oa):
    stream = oa.chat.completions.create(model="tiny", max_tokens=3, stream=True, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(PNG)}}]}])
    chunks = list(stream)
    assert chunks and chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("case", sorted(BAD))
def test_openai_bad_images_are_400s_naming_the_part(oa, case):
    with pytest.raises(openai.BadRequestError) as err:
        _openai_image(oa, f"data:image/png;base64,{BAD[case]}")
    assert "messages.0.content.1.image_url" in str(err.value.body), err.value.body
    assert _openai_image(oa, _data_url(PNG)).choices[0].finish_reason == "length"  # still serving


def test_openai_http_and_file_urls_are_fetched(oa, images_http, media_dir):
    """The same picture from a data URL, the loopback server and the allowed directory: the same prompt, answer."""
    want = _openai_image(oa, _data_url(PNG))
    for url in (images_http.url("/img.png"), (media_dir / "cat.png").as_uri()):
        got = _openai_image(oa, url)
        assert got.usage is not None and want.usage is not None
        assert (got.choices[0].message.content, got.usage.prompt_tokens) == (
            want.choices[0].message.content, want.usage.prompt_tokens)


@pytest.mark.parametrize(("where", "kind"), [("/missing", "fetch_failed"), ("localhost", "disallowed_url"),
                                             ("file-outside", "disallowed_url"), ("ftp", "disallowed_url")])
def test_openai_bad_image_urls_are_400s(oa, images_http, where, kind):
    url = {"/missing": images_http.url("/missing"), "localhost": images_http.url("/img.png", "localhost"),
           "file-outside": "file:///etc/hostname", "ftp": "ftp://127.0.0.1/cat.png"}[where]
    with pytest.raises(openai.BadRequestError) as err:
        _openai_image(oa, url)
    body = err.value.body
    assert isinstance(body, dict) and body.get("code") == kind, body
    assert body.get("param") == "messages.0.content.1.image_url", body
    assert _openai_image(oa, _data_url(PNG)).choices[0].finish_reason == "length"  # still serving


def test_limit_mm_per_prompt(oa):
    image = {"type": "image_url", "image_url": {"url": _data_url(PNG)}}
    ok = oa.chat.completions.create(model="tiny", max_tokens=2, messages=[
        {"role": "user", "content": [image, image]}])
    assert ok.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="--limit-mm-per-prompt") as err:
        oa.chat.completions.create(model="tiny", max_tokens=2, messages=[
            {"role": "user", "content": [image, image]}, {"role": "assistant", "content": "two"},
            {"role": "user", "content": [image]}])
    assert isinstance(err.value.body, dict) and err.value.body.get("param") == "messages.2.content.0.image_url"


def test_anthropic_image_request_answers(an):
    msg = _anthropic_image(an, {"type": "base64", "media_type": "image/png", "data": base64.b64encode(PNG).decode()})
    assert msg.stop_reason == "max_tokens" and msg.usage.input_tokens > 6


@pytest.mark.parametrize("case", sorted(BAD))
def test_anthropic_bad_images_are_400s_naming_the_block(an, case):
    with pytest.raises(anthropic.BadRequestError) as err:
        _anthropic_image(an, {"type": "base64", "media_type": "image/png", "data": BAD[case]})
    assert "messages.0.content.0.source" in str(err.value.body), err.value.body
    ok = _anthropic_image(an, {"type": "base64", "media_type": "image/png", "data": base64.b64encode(PNG).decode()})
    assert ok.stop_reason == "max_tokens"


def test_anthropic_url_sources_are_fetched(an, images_http):
    by_data = _anthropic_image(an, {"type": "base64", "media_type": "image/png",
                                    "data": base64.b64encode(PNG).decode()})
    by_url = _anthropic_image(an, {"type": "url", "url": images_http.url("/img.png")})
    assert by_url.usage.input_tokens == by_data.usage.input_tokens
    assert [b.model_dump() for b in by_url.content] == [b.model_dump() for b in by_data.content]
    with pytest.raises(anthropic.BadRequestError, match="allowed-media-domains"):
        _anthropic_image(an, {"type": "url", "url": "https://example.com/cat.png"})
    with pytest.raises(anthropic.BadRequestError, match="type: url"):
        _anthropic_image(an, {"type": "file", "file_id": "f"})


def test_a_model_without_a_vision_tower_refuses_images(tiny_dir, tmp_path_factory):
    live = start_server(tiny_dir("k3"), tmp_path_factory.mktemp("k3-text-server"), "--max-model-len", "512")
    try:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
        with pytest.raises(openai.BadRequestError, match="no vision tower"):
            _openai_image(client, _data_url(PNG))
        resp = client.chat.completions.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert resp.choices[0].finish_reason == "length"
    finally:
        stop_server(live)
