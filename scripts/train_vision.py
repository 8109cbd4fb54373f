"""Give the embedded default model a small vision tower, trained offline on synthetic Pillow images.

The tokenizer gains the four Kimi media tokens (`<|media_begin|>`, `<|media_content|>`, `<|media_end|>`,
`<|media_pad|>`) as ids 4096-4099; the embedding and LM-head rows of the new ids start as copies of `[PAD]`'s (a token
the model learned never to write), and the LM-head rows stay so. The draft model gets the same four rows. Trained:
the vision tower, the projector, the three marker embeddings, and with `--lm-lr` the language model too, with
`--text-rows` rows of its own training mix per step (train_tiny.py's data) so that it keeps its tool calling.

The tower is deltaserve's own `KimiVisionModel` (MoonViT: the layers the server runs, differentiable in torch),
the language model transformers' `KimiLinearForCausalLM` with `train_chunk_kda` (as `train_tiny.py`); images are
preprocessed by deltaserve's image processor and prompts rendered by its chat format, so training and serving
inputs are identical. Examples come from `make_vision_data.py` (train split). Deterministic for a seed and thread
count.

    python scripts/train_vision.py --model deltaserve/default_model --out /tmp/vt --steps 800 --warmup 30 \
        --lm-lr 5e-4 --text-rows 2 --seed 0 --time-limit-min 46
    python scripts/eval_vision.py --model /tmp/vt --n 400

The shipped checkpoint is three runs of this script, each continuing the last (the model card, Vision); the first
started from the text stage's checkpoint (the embedded model at commit c5d67e9, before it had a tower):

    python scripts/train_vision.py --model deltaserve/default_model --out /tmp/vt1 --steps 800 --warmup 30 \
        --lm-lr 5e-4 --text-rows 2 --seed 0 --time-limit-min 46                      # 39 min, 32% held out
    python scripts/train_vision.py --model /tmp/vt1 --init-from /tmp/vt1 --out /tmp/vt3 --steps 1150 --warmup 20 \
        --lr 1e-3 --lm-lr 3e-4 --text-rows 2 --seed 1 --extra-phrasings --time-limit-min 64   # 49 min, 48%
    python scripts/train_vision.py --model /tmp/vt3 --init-from /tmp/vt3 --out /tmp/vt4 --steps 300 --warmup 10 \
        --lr 3e-4 --lm-lr 1e-4 --text-rows 6 --seed 2 --extra-phrasings --time-limit-min 22    # 15 min, 58%

(the last with more text rows, to win back tool calling). With the language model frozen (`--lm-lr 0`, the first
attempt) 1,400 steps in 54 minutes reached 15%: that model cannot answer even from a text caption, so it has to
learn along with the tower. `--init-from` takes the tower and markers from a checkpoint that has them (the language
model comes from --model).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_tool_data import make_conversations, render_example  # noqa: E402
from make_vision_data import make_example, split_rng  # noqa: E402
from train_tiny import CODE_CHARS, Batches, lr_at, make_model_eval, masked_losses, read_code, tokenize_code  # noqa: E402

from deltaserve.chat import ChatMessage, get_chat_format  # noqa: E402
from deltaserve.chat.media import MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD, MEDIA_TOKENS, ImageSlot  # noqa: E402
from deltaserve.config.vision import parse_vision  # noqa: E402
from deltaserve.models.kimi_vision import KimiVisionModel  # noqa: E402
from deltaserve.multimodal import ImageProcessingConfig, preprocess_image  # noqa: E402
from deltaserve.multimodal.image_loader import load_pil_image  # noqa: E402
from deltaserve.text.tokenizer import Tokenizer  # noqa: E402

BASE_VOCAB = 4096
PAD_TOKEN = "[PAD]"
VISION_CONFIG = {
    "model_type": "kimi_k3_vision", "patch_size": 14, "init_pos_emb_height": 16, "init_pos_emb_width": 16,
    "init_pos_emb_time": 4, "pos_emb_type": "divided_fixed", "vt_num_attention_heads": 4, "vt_num_hidden_layers": 3,
    "vt_hidden_size": 96, "vt_intermediate_size": 256, "merge_kernel_size": [2, 2],
    "video_attn_type": "spatial_temporal", "merge_type": "sd2_tpool", "mm_projector_type": "patchmerger",
    "mm_hidden_size": 96, "projector_hidden_act": "gelu", "projector_ln_eps": 1e-5,
    # Images are scaled down to at most 16 x 16 patches (224 x 224 pixels): the sizes the tower was trained on.
    "max_patches": 256, "max_patches_per_side": 16,
}  # fmt: skip


# ---------------------------------------------------------------- checkpoint surgery
def extend_tokenizer(model_dir: Path, out: Path) -> dict[str, int]:
    """`tokenizer.json` / `tokenizer_config.json` with the four media tokens after the base vocabulary (idempotent)."""
    tok = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
    missing = [t for t in MEDIA_TOKENS if tok.token_to_id(t) is None]
    if missing:
        if tok.get_vocab_size(with_added_tokens=True) != BASE_VOCAB:
            raise SystemExit(f"{model_dir}: expected a {BASE_VOCAB}-token vocabulary before the media tokens")
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in MEDIA_TOKENS])
    ids = {t: tok.token_to_id(t) for t in MEDIA_TOKENS}
    if sorted(ids.values()) != list(range(BASE_VOCAB, BASE_VOCAB + len(MEDIA_TOKENS))):
        raise SystemExit(f"media token ids {ids} are not the ids after the base vocabulary")
    tok.save(str(out / "tokenizer.json"))
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    added = config["added_tokens_decoder"]
    for token, i in ids.items():
        added[str(i)] = {"content": token, "lstrip": False, "normalized": False, "rstrip": False,
                         "single_word": False, "special": True}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return ids


def padded_text_weights(weights: dict[str, torch.Tensor], pad_id: int) -> dict[str, torch.Tensor]:
    """The language model's tensors with embedding and LM-head rows for the media ids, copies of `[PAD]`'s."""
    out = {k: v for k, v in weights.items() if not k.startswith(("vision_tower.", "mm_projector."))}
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        base = out[name][:BASE_VOCAB]
        out[name] = torch.cat([base, base[pad_id].expand(len(MEDIA_TOKENS), -1)]).contiguous()
    return out


def text_config(raw: dict, media: dict[str, int]) -> dict:
    """config.json of the model with its media tokens (and, once trained, `vision_config`)."""
    raw = {k: v for k, v in raw.items() if k not in ("vision_config", "media_placeholder_token_id")}
    return {**raw, "vocab_size": BASE_VOCAB + len(MEDIA_TOKENS), "media_placeholder_token_id": media[MEDIA_PAD]}


def make_text_batches(model_dir: Path, seed: int) -> Batches:
    """Rows of the language model's own training mix (`scripts/train_default_model.sh`'s settings), rendered with
    the extended tokenizer (the text ids are unchanged: the media tokens come after them)."""
    tok = Tokenizer.from_pretrained(model_dir)
    fmt = get_chat_format(model_dir, tok)
    convs = [render_example(fmt, c)
             for c in make_conversations("train", 20000, seed + 1, synthetic=0.9, plain_share=0.65, short_copy=True,
                                         copy_share=0.7, list_share=0.5, neutral_share=0.3)]
    code = tokenize_code(model_dir, read_code("train", CODE_CHARS))
    return Batches(convs, code, 640, seed + 1, 0.1)


# ---------------------------------------------------------------- the tower
def init_vision(model: KimiVisionModel, seed: int) -> None:
    """Fan-in-scaled matrices, unit norms, zero biases, a small position grid; trainable."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.checkpoint_tensors().items():
            assert isinstance(t, torch.Tensor)
            if name.endswith("pos_emb.weight"):
                t.copy_(0.02 * torch.randn(t.shape, generator=gen))
            elif t.dim() == 1:
                t.fill_(1.0 if "norm" in name and name.endswith(".weight") else 0.0)
            else:
                t.copy_(torch.randn(t.shape, generator=gen) / math.sqrt(math.prod(t.shape[1:])))
    for p in model.parameters():
        p.requires_grad_(True)


class Example:
    """One rendered training example: prompt + answer ids, the answer's loss mask, the image's patches, its caption's
    ids (cut to the image's token count)."""

    def __init__(self, ids: list[int], mask: list[int], pixels: torch.Tensor, grid: tuple[int, int, int],
                 caption: list[int]) -> None:
        self.ids, self.mask, self.pixels, self.grid, self.caption = ids, mask, pixels, grid, caption


def render(fmt, tok: Tokenizer, processing: ImageProcessingConfig, rng: random.Random,
           extra_phrasings: bool = False) -> Example:
    ex = make_example(rng, extra_phrasings=extra_phrasings)
    image = preprocess_image(load_pil_image(ex.image), processing)
    at_end = rng.random() < 0.3  # the image after the question sometimes, before it mostly (as clients send)
    slot = ImageSlot(position=len(ex.question) if at_end else 0, num_tokens=image.num_tokens)
    prompt = fmt.render([ChatMessage(role="user", content=ex.question, images=(slot,))], thinking=False)
    answer = tok.encode(ex.answer, allow_special=False, max_tokens=None) + [tok.special_tokens["<|im_end|>"]]
    caption = tok.encode(ex.caption, allow_special=False, max_tokens=None)[: image.num_tokens]
    return Example(prompt + answer, [0] * len(prompt) + [1] * len(answer), torch.from_numpy(image.pixel_values),
                   image.grid_thw, caption)


def main() -> None:  # noqa: PLR0915, C901 - a linear script
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path("deltaserve/default_model"))
    parser.add_argument("--out", type=Path, default=None, help="where to write (default: --model, in place)")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=24)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--caption-weight", type=float, default=0.0,
                        help="weight of the auxiliary loss that pulls an image's first tokens to the embeddings of "
                             "its caption's tokens (a form the frozen model already copies from)")
    parser.add_argument("--init-from", type=Path, default=None,
                        help="start the tower, projector and marker embeddings from this checkpoint's")
    parser.add_argument("--lm-lr", type=float, default=0.0,
                        help="also train the language model at this peak learning rate (0: frozen). The frozen model "
                             "cannot answer even from a text caption (12.5%% of held-out questions), so reading "
                             "images needs it trained; --text-rows keeps its text skills")
    parser.add_argument("--text-rows", type=int, default=0,
                        help="rows of the language model's own training data (train_tiny.py's mix) per step, so that "
                             "training on images does not erase its tool calling")
    parser.add_argument("--extra-phrasings", action="store_true",
                        help="ask make_vision_data's training-only phrasings too (never the held-out ones)")
    parser.add_argument("--time-limit-min", type=float, default=None,
                        help="stop early (cosine schedule still planned for --steps) and save")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = args.out or args.model
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()

    raw = json.loads((args.model / "config.json").read_text())
    weights = load_file(str(args.model / "model.safetensors"))
    work = Path(tempfile.mkdtemp(prefix="deltaserve-vision-"))
    media = extend_tokenizer(args.model, work)
    tok = Tokenizer.from_pretrained(work)
    pad_id = tok.special_tokens[PAD_TOKEN]
    text = padded_text_weights(weights, pad_id)
    config = text_config(raw, media)
    (work / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(text, str(work / "model.safetensors"), metadata={"format": "pt"})
    lm = make_model_eval(work)  # fp32
    for p in lm.parameters():
        p.requires_grad_(args.lm_lr > 0)
    text_batches = make_text_batches(work, args.seed) if args.text_rows else None

    vision_config = parse_vision({"vision_config": VISION_CONFIG}, raw["hidden_size"])
    assert vision_config is not None
    vision = KimiVisionModel(vision_config)
    init_vision(vision, args.seed)
    marker_ids = [media[MEDIA_BEGIN], media[MEDIA_CONTENT], media[MEDIA_END]]
    markers = torch.nn.Parameter(text["model.embed_tokens.weight"][marker_ids].float().clone())
    if args.init_from is not None:
        start = load_file(str(args.init_from / "model.safetensors"))
        with torch.no_grad():
            for name, t in vision.checkpoint_tensors().items():
                assert isinstance(t, torch.Tensor)
                t.copy_(start[name].float())
            markers.copy_(start["model.embed_tokens.weight"][marker_ids].float())
    embed_table = lm.model.embed_tokens.weight.detach()
    embed_scale = float(embed_table[:BASE_VOCAB].pow(2).mean())
    params = [*vision.parameters(), markers]
    decay = [p for p in vision.parameters() if p.dim() >= 2]
    no_decay = [p for p in vision.parameters() if p.dim() < 2] + [markers]
    groups = [{"params": decay, "weight_decay": 0.01, "peak": args.lr},
              {"params": no_decay, "weight_decay": 0.0, "peak": args.lr}]
    if args.lm_lr > 0:
        lm_params = list(lm.parameters())
        params += lm_params
        groups.append({"params": lm_params, "weight_decay": 0.05, "peak": args.lm_lr})
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    fmt = get_chat_format(work, tok)
    processing = ImageProcessingConfig.for_vision(vision_config)
    rng = split_rng("train", args.seed)
    placeholder = media[MEDIA_PAD]
    print(f"vision tower {sum(p.numel() for p in vision.parameters()) / 1e6:.2f}M parameters; language model "
          f"{f'trained (peak lr {args.lm_lr:g}, {args.text_rows} text rows per step)' if args.lm_lr else 'frozen'}; "
          f"{args.steps} steps of {args.batch}", flush=True)

    log: list[dict] = []
    window: list[float] = []
    caption_window: list[float] = []
    text_window: list[float] = []
    tokens_seen = 0
    step = 0
    for step in range(args.steps):
        batch = [render(fmt, tok, processing, rng, args.extra_phrasings) for _ in range(args.batch)]
        width = max(len(e.ids) for e in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.bool)
        for i, e in enumerate(batch):
            ids[i, : len(e.ids)] = torch.tensor(e.ids)
            mask[i, : len(e.mask)] = torch.tensor(e.mask, dtype=torch.bool)
        feats = vision(torch.cat([e.pixels for e in batch]), [e.grid for e in batch])
        emb = lm.model.embed_tokens(ids)
        for k, marker in enumerate(marker_ids):
            emb = torch.where((ids == marker)[..., None], markers[k], emb)
        emb = emb.masked_scatter((ids == placeholder)[..., None], feats.to(emb.dtype))
        caption_loss = feats.new_zeros(())
        if args.caption_weight:
            rows, targets, offset = [], [], 0
            for e in batch:
                rows += range(offset, offset + len(e.caption))
                targets += e.caption
                offset += e.grid[1] * e.grid[2] // vision_config.merge_area
            caption_loss = (feats[rows] - embed_table[targets]).pow(2).mean() / embed_scale
        hidden = lm.model(inputs_embeds=emb).last_hidden_state
        # position t predicts token t + 1: the loss is over the answer tokens
        target = mask[:, 1:]
        logits = lm.lm_head(hidden[:, :-1][target])
        answer_loss = F.cross_entropy(logits.float(), ids[:, 1:][target])
        loss = answer_loss + args.caption_weight * caption_loss
        if text_batches is not None:
            text_ids, kind = text_batches.batch(args.text_rows)
            text_logits = lm(input_ids=text_ids).logits
            conv_loss, code_loss = masked_losses(text_logits, text_ids, kind)
            loss = loss + conv_loss + 0.3 * code_loss
            text_window.append(float(conv_loss.detach()))
        lr = lr_at(step, args.steps, args.lr, args.warmup)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, group["peak"], args.warmup)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        tokens_seen += int(ids.numel())
        window.append(float(answer_loss.detach()))
        caption_window.append(float(caption_loss.detach()))
        if step % 10 == 9 or step == args.steps - 1:
            elapsed = time.time() - started
            mean, caption_mean = sum(window) / len(window), sum(caption_window) / len(caption_window)
            text_mean = sum(text_window) / len(text_window) if text_window else 0.0
            window, caption_window, text_window = [], [], []
            log.append({"step": step + 1, "loss": round(mean, 4), "caption_loss": round(caption_mean, 4),
                        "text_loss": round(text_mean, 4), "lr": lr, "elapsed_s": round(elapsed, 1)})
            eta = elapsed / (step + 1) * (args.steps - step - 1)
            print(f"step {step + 1}/{args.steps} loss {mean:.4f} caption {caption_mean:.4f} text {text_mean:.4f} "
                  f"lr {lr:.2e} "
                  f"{tokens_seen / elapsed:.0f} tok/s elapsed {elapsed / 60:.1f} min eta {eta / 60:.1f} min",
                  flush=True)
        if args.time_limit_min is not None and time.time() - started > 60 * args.time_limit_min:
            print(f"time limit reached after {step + 1} steps", flush=True)
            break

    # ------------------------------------------------------------ write the checkpoint
    final = dict(text)
    if args.lm_lr > 0:  # the trained language model, in the checkpoint's dtypes
        for name, t in lm.state_dict().items():
            if name in final:
                final[name] = t.detach().to(final[name].dtype).contiguous()
    embed = final["model.embed_tokens.weight"].clone()
    embed[marker_ids] = markers.detach().to(embed.dtype)
    final["model.embed_tokens.weight"] = embed
    for name, t in vision.checkpoint_tensors().items():
        assert isinstance(t, torch.Tensor)
        final[name] = t.detach().to(torch.bfloat16).contiguous()
    save_file(final, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**config, "vision_config": VISION_CONFIG}, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((work / name).read_bytes())
    draft = args.model / "draft"
    if draft.is_dir():
        extend_draft(draft, out / "draft", work, pad_id)
    meta = {"args": {k: str(v) for k, v in vars(args).items()}, "steps_run": step + 1,
            "minutes": round((time.time() - started) / 60, 1), "log": log}
    (out / "vision_training.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"wrote {out} after {(time.time() - started) / 60:.1f} min", flush=True)


def extend_draft(draft: Path, out: Path, tokenizer_dir: Path, pad_id: int) -> None:
    """The draft model gets the same vocabulary: its rows for the media ids are copies of its `[PAD]` rows."""
    out.mkdir(parents=True, exist_ok=True)
    raw = json.loads((draft / "config.json").read_text())
    weights = padded_text_weights(load_file(str(draft / "model.safetensors")), pad_id)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**raw, "vocab_size": BASE_VOCAB + len(MEDIA_TOKENS)}, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((tokenizer_dir / name).read_bytes())


if __name__ == "__main__":
    main()
