"""Train the block drafter (`deltaserve/models/dspark.py`) of the embedded default model, offline on a CPU.

1. Data: the embedded model's own greedy generations (through deltaserve's `LLM`, max 128 tokens) on prompts of its
   training distribution: chats of `make_tool_data.py`'s train split with the mix of `train_default_model.sh`,
   rendered up to each assistant turn, and plain-text windows of standard-library code (train split of
   `train_tiny.py`).
2. Features: each sequence (prompt + generation) through the target once (deltaserve's `ModelRunner`, the forward
   the engine runs), its taps (`FeatureTaps`) kept from the last `context_window` prompt positions on.
3. Training: anchors N in the generated part; context = taps at N - W .. N - 1, block = [x_N, MASK x k]; loss =
   cross-entropy of x_{N+1..N+k} at the mask rows, weighted by `position_weights`, through the target's frozen
   embedding and LM head. AdamW, warm-up + cosine over a wall budget (`--time-limit-min`). Held-out sequences give
   per-position accuracy and the greedy acceptance length (accepted drafts per block + 1).

    python scripts/train_dspark.py --out deltaserve/default_model/dspark --time-limit-min 40 --threads 1
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_tool_data import TOOLS, make_conversations, messages_of  # noqa: E402
from train_tiny import read_code  # noqa: E402

from deltaserve import LLM, SamplingParams  # noqa: E402
from deltaserve.chat import get_chat_format  # noqa: E402
from deltaserve.default_model import default_model_dir  # noqa: E402
from deltaserve.models.dspark import DSparkConfig, DSparkDrafter  # noqa: E402
from deltaserve.models.loader import load_model  # noqa: E402
from deltaserve.spec_decode.dspark_training import (  # noqa: E402
    acceptance_length,
    drafter_loss,
    sequence_features,
    training_batch,
)
from deltaserve.text.tokenizer import Tokenizer  # noqa: E402


def chat_prompts(n: int, seed: int, split: str = "train") -> list[list[int]]:
    """Generation prompts of `n` conversations of the training mix, the history up to each assistant turn."""
    model_dir = default_model_dir()
    fmt = get_chat_format(model_dir, Tokenizer.from_pretrained(model_dir))
    out = []
    for conv in make_conversations(split, n, seed, plain_share=0.65, synthetic=0.9, short_copy=True,
                                   copy_share=0.7, list_share=0.5, neutral_share=0.3):
        msgs = messages_of(conv)
        for t in (t for t, m in enumerate(msgs) if m.role == "assistant"):
            out.append(list(fmt.render(msgs[:t], tools=TOOLS if conv.offer_tools else (), thinking=conv.thinking,
                                       add_generation_prompt=True)))
    return out


def code_prompts(n: int, seed: int, tokenizer: Tokenizer) -> list[list[int]]:
    """`n` windows of 48..160 tokens of standard-library code (train split), for plain completion."""
    rng = random.Random(seed)
    ids = [tokenizer.encode(t) for t in read_code("train", 4_000_000)]
    ids = [x for x in ids if len(x) > 300]
    out = []
    for _ in range(n):
        row = rng.choice(ids)
        length = rng.randint(48, 160)
        start = rng.randrange(0, len(row) - length)
        out.append(row[start:start + length])
    return out


def generate(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    # The engine sizes the process's torch threads (default: every core); keep --threads for the training after it.
    llm = LLM(model=str(model_dir), max_num_seqs=64, enable_prefix_caching=False, num_threads=torch.get_num_threads())
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    out = []
    for i in range(0, len(prompts), 256):
        outs = llm.generate(prompts[i:i + 256], params)
        out += [list(o.outputs[0].token_ids) for o in outs]
        print(f"generated {len(out)}/{len(prompts)}", flush=True)
    llm.shutdown() if hasattr(llm, "shutdown") else None
    return out


def main() -> None:  # noqa: PLR0915 - a linear script
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="deltaserve/default_model/dspark")
    ap.add_argument("--work", default="/tmp/deltaserve-dspark")
    ap.add_argument("--conversations", type=int, default=1500)
    ap.add_argument("--code", type=int, default=600)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=7)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--taps", default="1,2,3")
    ap.add_argument("--anchors", type=int, default=512, help="anchors (blocks) per step")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--time-limit-min", type=float, default=40.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.time()
    model_dir = default_model_dir()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    data_file = work / "sequences.json"
    if data_file.exists():
        seqs = [tuple(x) for x in json.loads(data_file.read_text())]
    else:
        tok = Tokenizer.from_pretrained(model_dir)
        prompts = chat_prompts(args.conversations, args.seed) + code_prompts(args.code, args.seed, tok)
        outs = generate(model_dir, prompts, args.max_tokens)
        seqs = [(p + o, len(p)) for p, o in zip(prompts, outs, strict=True) if len(o) >= 2]
        data_file.write_text(json.dumps(seqs))
    print(f"{len(seqs)} sequences, {sum(len(s) - p for s, p in seqs)} generated tokens "
          f"({time.time() - started:.0f} s)", flush=True)
    target = load_model(model_dir)
    tcfg = target.config
    cfg = DSparkConfig(vocab_size=tcfg.vocab_size, hidden_size=tcfg.hidden_size,
                       tap_layers=tuple(int(x) for x in args.taps.split(",")), num_layers=args.layers,
                       num_heads=4, intermediate_size=384, block_size=args.block_size,
                       context_window=args.window, rms_norm_eps=tcfg.rms_norm_eps)
    rows = sequence_features(target, seqs, cfg.tap_layers, cfg.context_window, progress_every=500)
    print(f"features done ({time.time() - started:.0f} s)", flush=True)
    rng = random.Random(args.seed)
    order = list(range(len(rows)))
    rng.shuffle(order)
    held = set(order[: max(1, len(rows) // 20)])
    train_anchors = [(r, n) for r in range(len(rows)) if r not in held for n in rows[r].anchors()]
    held_anchors = [(r, n) for r in sorted(held) for n in rows[r].anchors()]
    print(f"{len(train_anchors)} training anchors, {len(held_anchors)} held out", flush=True)
    embed_w = target.embed_tokens.detach().float()
    head_w = target.lm_head.detach().float()
    drafter = DSparkDrafter(cfg).init_for_training()
    opt = torch.optim.AdamW(drafter.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    budget = args.time_limit_min * 60
    train_start = time.time()
    step, log = 0, []

    def loss_of(anchors: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return drafter_loss(drafter, training_batch(rows, anchors, cfg), embed_w, head_w)

    while True:
        frac = (time.time() - train_start) / budget
        if frac >= 1.0:
            break
        lr = args.lr * min(1.0, (step + 1) / 30) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for g in opt.param_groups:
            g["lr"] = lr
        loss, _, _ = loss_of(rng.sample(train_anchors, args.anchors))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        if step % 50 == 0:
            log.append({"step": step, "loss": round(loss.item(), 4), "lr": lr,
                        "minutes": round((time.time() - train_start) / 60, 2)})
            print(json.dumps(log[-1]), flush=True)
        if step % 500 == 0 and step:
            drafter.save(args.out)
        step += 1
    drafter.save(args.out)
    with torch.no_grad():
        parts = [loss_of(held_anchors[i:i + 1024])[1:] for i in range(0, len(held_anchors), 1024)]
    correct, real = torch.cat([c for c, _ in parts]), torch.cat([r for _, r in parts])
    accuracy = (correct.sum(0) / real.sum(0).clamp_min(1)).tolist()
    result = {"steps": step, "train_minutes": round((time.time() - train_start) / 60, 1),
              "total_minutes": round((time.time() - started) / 60, 1),
              "heldout_position_accuracy": [round(x, 3) for x in accuracy],
              "heldout_acceptance_length": round(acceptance_length(correct), 3),
              "sequences": len(seqs), "train_anchors": len(train_anchors), "args": vars(args), "log": log}
    Path(args.out, "training.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "log"}), flush=True)


if __name__ == "__main__":
    main()
