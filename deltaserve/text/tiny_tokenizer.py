"""A tiny, deterministic, offline byte-level BPE tokenizer with Kimi's special tokens (K2 or K3 set), for tests.

`write_tiny_tokenizer` trains it with `tokenizers` on a built-in corpus and writes `tokenizer.json` or Kimi's
`tiktoken.model` format, plus `tokenizer_config.json`; `deltaserve.text.tokenizer.Tokenizer` loads either.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from deltaserve.text.tokenizer import (
    KIMI_PAT_STR,
    TIKTOKEN_MODEL,
    TOKENIZER_CONFIG,
    TOKENIZER_JSON,
    bytes_to_unicode,
)

# The K2 flavour (the default), the last len(TINY_SPECIAL_TOKENS) ids of the vocab in this order: Kimi K2 / Kimi
# Linear's named specials in ascending Kimi id order (model-spec §11.1), then the K2.x thinking pair, with [UNK] and
# [PAD] last as in Kimi.
TINY_SPECIAL_TOKENS: tuple[str, ...] = (
    "[BOS]",
    "[EOS]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "[EOT]",
    "<|im_system|>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<|im_middle|>",
    "<think>",
    "</think>",
    "[UNK]",
    "[PAD]",
)
# The K3 flavour (model-spec §11.2): Kimi K3's named specials in ascending Kimi id order, [UNK] and [PAD] last.
# Ids 163586..163591 of K3 carry different tokens than K2, so K3 prompts cannot be tested on the K2 set.
TINY_K3_SPECIAL_TOKENS: tuple[str, ...] = (
    "[BOS]",
    "[EOS]",
    "<|end_of_msg|>",
    "<|open|>",
    "<|close|>",
    "<|sep|>",
    "[start_header_id]",
    "[end_header_id]",
    "[EOT]",
    "<|media_begin|>",
    "<|media_content|>",
    "<|media_end|>",
    "<|media_pad|>",
    "<osagent_mode>",
    "[UNK]",
    "[PAD]",
)
# The K2 flavour with the four media tokens after it (a Kimi Linear checkpoint with a vision tower; the same order
# `scripts/train_vision.py` appends them in).
TINY_K2_VISION_SPECIAL_TOKENS: tuple[str, ...] = (
    *TINY_SPECIAL_TOKENS, "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>",
)
FLAVORS: dict[str, tuple[str, ...]] = {"k2": TINY_SPECIAL_TOKENS, "k3": TINY_K3_SPECIAL_TOKENS,
                                       "k2_vision": TINY_K2_VISION_SPECIAL_TOKENS}
# The checkpoint config's eos of each family.
_CONFIG_EOS = {"k2": "<|im_end|>", "k3": "<|end_of_msg|>", "k2_vision": "<|im_end|>"}
MIN_VOCAB_SIZE = 300  # 256 byte tokens + the specials + a few merges
_MAX_FILLER_LINES = 1 << 17
FORMATS = ("tokenizers", "tiktoken")

_CORPUS = '''\
The quick brown fox jumps over the lazy dog. A serving engine batches requests from many users.
Each request carries a prompt, sampling parameters and a maximum number of new tokens to generate.
The scheduler decides which requests run in the next step and how many prompt tokens each may prefill.
Linear attention keeps a fixed-size state per sequence, so memory does not grow with the context length.
Kimi Linear interleaves three delta-attention layers with one full attention layer that uses latent keys.
When the cache is full, the engine preempts the newest request and resumes it later without losing work.
Tokens stream back to the client as soon as they are decoded; a stop string ends the response early.
She said it's late, we're tired, they've gone home, I'm staying, you'll see, he'd know, that'll do.
Numbers such as 3, 42, 1024, 65536 and 3.14159 appear in logs, configs and benchmark tables.
On Monday the team measured throughput: 12,345 tokens per second at batch size 64, up 17% from Friday.
Café, naïve, résumé, Straße, Ελληνικά, русский, 日本語, 中文字符, 한국어, emoji 😀🎉🚀 and a tab\tor two.

def softmax(logits: list[float], temperature: float = 1.0) -> list[float]:
    """Return a probability distribution over the vocabulary."""
    if temperature <= 0.0:
        raise ValueError("temperature must be positive")
    scaled = [x / temperature for x in logits]
    peak = max(scaled)
    weights = [math.exp(x - peak) for x in scaled]
    total = sum(weights)
    return [w / total for w in weights]


class Request:
    def __init__(self, request_id: str, prompt_ids: list[int], max_tokens: int = 16) -> None:
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.output_ids: list[int] = []
        self.max_tokens = max_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def is_finished(self, eos_token_id: int) -> bool:
        if len(self.output_ids) >= self.max_tokens:
            return True
        return bool(self.output_ids) and self.output_ids[-1] == eos_token_id


for step, batch in enumerate(scheduler.schedule()):
    outputs = runner.execute(batch)
    for request, token in zip(batch.requests, outputs.sampled_ids, strict=True):
        request.output_ids.append(token)
        print(f"step {step}: {request.request_id} -> {token}")

{"model": "kimi-linear", "messages": [{"role": "user", "content": "Hello!"}], "stream": true}
'''
_SYLLABLES = (
    "ka", "lo", "mi", "ten", "ra", "su", "vel", "or", "an", "ish", "qu", "zor",
    "pe", "dy", "gh", "ex", "th", "ing", "ou", "ble", "str", "io", "ne", "wa",
)  # fmt: skip


def _filler(num_lines: int) -> Iterator[str]:
    """Deterministic pseudo-words (own 64-bit LCG, stable across Python versions) to reach large vocab sizes."""
    state = 0x2545F4914F6CDD1D
    for _ in range(num_lines):
        words = []
        for _ in range(12):
            state = (state * 6364136223846793005 + 1442695040888963407) % (1 << 64)
            length = 1 + (state >> 60) % 4
            words.append("".join(_SYLLABLES[(state >> (8 * k + 16)) % len(_SYLLABLES)] for k in range(length)))
        yield " ".join(words)


def _train(num_base: int, corpus: Sequence[str] | None = None) -> HFTokenizer:
    """Byte-level BPE with Kimi's pre-tokenizer regex and exactly `num_base` tokens (no specials yet).

    Trained on `corpus` when given (pseudo-word filler is added only if it cannot fill the vocab), else on the
    built-in text."""
    base_corpus = list(corpus) if corpus is not None else _CORPUS.splitlines(keepends=True)
    num_filler = 0
    while True:
        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(KIMI_PAT_STR), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=num_base,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            special_tokens=[],
            show_progress=False,
        )
        tok.train_from_iterator([*base_corpus, *_filler(num_filler)], trainer)
        if tok.get_vocab_size() == num_base:
            return tok
        if num_filler >= _MAX_FILLER_LINES:
            raise ValueError(f"vocab_size too large for the tiny tokenizer corpus (reached {tok.get_vocab_size()})")
        num_filler = max(256, 2 * num_filler)


def write_tiny_tokenizer(
    out_dir: Path,
    vocab_size: int,
    *,
    fmt: str = "tokenizers",
    model_max_length: int = 1_048_576,
    flavor: str = "k2",
    corpus: Sequence[str] | None = None,
) -> dict[str, int]:
    """Train and write a tiny tokenizer whose vocab, specials included, has exactly `vocab_size` ids.

    Args:
        out_dir: created if needed; receives `tokenizer_config.json` and `tokenizer.json` (fmt "tokenizers") or
            `tiktoken.model` (fmt "tiktoken"). The other format's file is removed so the loader sees one.
        vocab_size: total ids; the flavour's specials (`TINY_SPECIAL_TOKENS` for "k2", `TINY_K3_SPECIAL_TOKENS` for
            "k3") take the last ones, in order. At least `MIN_VOCAB_SIZE`.
        fmt: "tokenizers" or "tiktoken". Both hold the same byte-level BPE (tiktoken rank == tokenizers id).
        model_max_length: written to `tokenizer_config.json`.
        flavor: "k2" (Kimi K2 / Kimi Linear specials, the default), "k3" (Kimi K3's XTML specials) or "k2_vision"
            (k2's, then the four media tokens).
        corpus: training texts for the BPE (none: the built-in corpus); used for the embedded default model.

    Returns:
        {"bos_token_id": [BOS], "eos_token_id": the config eos (<|im_end|> for k2, <|end_of_msg|> for k3),
        "pad_token_id": [PAD]}. `tokenizer_config.json` says eos_token "[EOS]"; a model config should use the
        returned eos id, and generation stops on both.
    """
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    if flavor not in FLAVORS:
        raise ValueError(f"flavor must be one of {tuple(FLAVORS)}, got {flavor!r}")
    specials = FLAVORS[flavor]
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB_SIZE}, got {vocab_size}")
    num_base = vocab_size - len(specials)
    tok = _train(num_base, corpus)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    ids = {t: num_base + n for n, t in enumerate(specials)}  # where add_special_tokens puts them on a fresh vocab
    landed = {t: tok.token_to_id(t) for t in specials}
    if landed != ids:
        raise RuntimeError(f"special tokens landed at {landed}, expected ids {num_base}..{vocab_size - 1}")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    keep, drop = (TOKENIZER_JSON, TIKTOKEN_MODEL) if fmt == "tokenizers" else (TIKTOKEN_MODEL, TOKENIZER_JSON)
    (out / drop).unlink(missing_ok=True)
    if fmt == "tokenizers":
        tok.save(str(out / keep), pretty=True)
    else:
        unbyte = {c: b for b, c in bytes_to_unicode().items()}
        vocab = sorted(tok.get_vocab(with_added_tokens=False).items(), key=lambda kv: kv[1])
        lines = [f"{base64.b64encode(bytes(unbyte[c] for c in s)).decode()} {rank}\n" for s, rank in vocab]
        (out / keep).write_text("".join(lines), encoding="utf-8")

    config: dict[str, object] = {
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for t, i in ids.items()
        },
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    if fmt == "tokenizers":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (out / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return {"bos_token_id": ids["[BOS]"], "eos_token_id": ids[_CONFIG_EOS[flavor]], "pad_token_id": ids["[PAD]"]}
