"""Train the embedded default model (`deltaserve/default_model/`): a small Kimi Linear checkpoint, offline.

Data, made on the machine with no download: the installed Python standard library (source files split by a hash of
their path into train / held-out) and synthetic tool-use conversations from `scripts/make_tool_data.py`, rendered
with deltaserve's own chat renderer. A byte-level BPE with the Kimi K2 special tokens is trained on that data with
`tokenizers`. The model is transformers' `KimiLinearForCausalLM` (the parity oracle of deltaserve), so the
checkpoint is the exact Kimi Linear format both load; only its KDA chunk function is swapped, for training speed, by
`train_chunk_kda` below (same math). Deterministic for a given seed and thread count; uses a GPU when present.

    python scripts/train_tiny.py --out deltaserve/default_model --steps 400 --seed 0
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_tool_data import TOOLS, make_conversations, messages_of, render_example  # noqa: E402

from deltaserve.chat import get_chat_format  # noqa: E402
from deltaserve.chat.format import deep_sort  # noqa: E402
from deltaserve.chat.kimi_k2 import DEFAULT_SYSTEM_PROMPT  # noqa: E402
from deltaserve.models.tiny import TinySpec, tiny_config_dict  # noqa: E402
from deltaserve.text.tiny_tokenizer import write_tiny_tokenizer  # noqa: E402
from deltaserve.text.tokenizer import Tokenizer  # noqa: E402

SPEC = TinySpec(
    layers=4, hidden=160, vocab=4096, intermediate=384, moe_intermediate=128, experts=8, top_k=2, shared_experts=1,
    num_expert_group=2, topk_group=1, kda_heads=4, kda_head_dim=32, mla_heads=4, kv_lora_rank=64,
    qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, first_k_dense=1,
)  # fmt: skip
MAX_LEN = 2048
CODE_CHARS = 3_000_000  # training code text budget
TOKENIZER_CODE_CHARS = 1_500_000  # of which the tokenizer trainer sees this much
HELDOUT_MOD = 20  # a stdlib file is held out when crc32(relative path) % HELDOUT_MOD == 0


# ---------------------------------------------------------------- data
def stdlib_files(split: str) -> list[Path]:
    """Python source files of the installed standard library (no tests, no site-packages), by split."""
    root = Path(os.__file__).resolve().parent
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("site-packages", "test/", "idlelib", "lib2to3/tests", "tkinter/test")) or "/tests/" in rel:
            continue
        held = zlib.crc32(rel.encode()) % HELDOUT_MOD == 0
        if held == (split == "heldout"):
            out.append(path)
    return out


def read_code(split: str, max_chars: int) -> list[str]:
    texts, total = [], 0
    for path in stdlib_files(split):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if total + len(text) > max_chars:
            continue
        texts.append(text)
        total += len(text)
    return texts


def conversation_texts(seed: int, n: int) -> list[str]:
    """The plain text pieces of rendered conversations (for the tokenizer trainer; specials excluded)."""
    decl = json.dumps(deep_sort([t.to_openai() for t in TOOLS]), ensure_ascii=False, separators=(",", ":"))
    # The fixed prompt parts recur in every conversation: weight them so the BPE gives them few tokens.
    pieces = [decl, DEFAULT_SYSTEM_PROMPT, "assistant", "user", "system", "tool", "tool_declare"] * (n // 4)
    for conv in make_conversations("train", n, seed):
        for m in messages_of(conv):
            pieces += [m.content, m.reasoning or ""]
            for c in m.tool_calls:
                pieces += [c.id, c.arguments]
            if m.role == "tool":
                pieces.append(f"## Return of {m.tool_call_id}\n{m.content}")
    return [p for p in pieces if p]


def build_tokenizer(out: Path, code: list[str], seed: int) -> dict[str, int]:
    budget, kept = TOKENIZER_CODE_CHARS, []
    for text in code:
        if budget <= 0:
            break
        kept.append(text[:budget])
        budget -= len(kept[-1])
    corpus = [*kept, *conversation_texts(seed, 8000)]
    return write_tiny_tokenizer(out, SPEC.vocab, corpus=corpus, model_max_length=MAX_LEN)


def tokenize_code(model_dir: Path, texts: list[str]) -> list[int]:
    tok = Tokenizer.from_pretrained(model_dir)
    stream: list[int] = []
    for text in texts:
        stream += tok.encode(text, allow_special=False)
    return stream


class Batches:
    """Rows of `seq_len` tokens: packed conversations (loss on assistant turns) filled up with code windows."""

    def __init__(self, convs: list[tuple[list[int], list[int]]], code: list[int], seq_len: int, seed: int,
                 code_rows: float) -> None:
        self.convs, self.code, self.seq_len, self.code_rows = convs, code, seq_len, code_rows
        self.rng = random.Random(seed)
        self.order: list[int] = []
        self.pending: tuple[list[int], list[int]] | None = None

    def _next_conv(self) -> tuple[list[int], list[int]]:
        if self.pending is not None:
            conv, self.pending = self.pending, None
            return conv
        if not self.order:
            self.order = list(range(len(self.convs)))
            self.rng.shuffle(self.order)
        return self.convs[self.order.pop()]

    def _code(self, n: int) -> list[int]:
        start = self.rng.randrange(0, len(self.code) - n)
        return self.code[start : start + n]

    def row(self) -> tuple[list[int], list[int]]:
        """(ids, kind per target: 0 none, 1 conversation, 2 code)."""
        ids: list[int] = []
        kind: list[int] = []
        if self.rng.random() >= self.code_rows:
            while True:
                conv_ids, conv_mask = self._next_conv()
                if len(ids) + len(conv_ids) > self.seq_len:
                    self.pending = (conv_ids, conv_mask)  # starts the next row
                    break
                ids += conv_ids
                kind += conv_mask
        fill = self.seq_len - len(ids)
        if fill:
            ids += self._code(fill)
            kind += [2] * fill
        return ids, kind

    def batch(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        data = [self.row() for _ in range(rows)]
        return torch.tensor([d[0] for d in data]), torch.tensor([d[1] for d in data])


# ---------------------------------------------------------------- model
def train_chunk_kda(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                    use_qk_l2norm_in_kernel=False, **kwargs):
    """transformers' reference `chunk_kimi_delta_attention`, rewritten for training speed; identical math.

    Chunks of 16 (the decay tensor is [B, H, n, C, C, K]) and the intra-chunk inverse (I + A)^-1 by one triangular
    solve instead of a row loop; fp32 inside, as the reference. Checked against the reference in `--check-kda`.
    """
    dtype = query.dtype
    q, k, v, b, g = [x.transpose(1, 2).to(torch.float32) for x in (query, key, value, beta, g)]
    if use_qk_l2norm_in_kernel:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    B, H, T, K = k.shape
    V = v.shape[-1]
    C = 16
    pad = (C - T % C) % C
    q = F.pad(q, (0, 0, 0, pad)) * K**-0.5
    k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (k, v, g))
    b = F.pad(b, (0, pad))
    n = (T + pad) // C
    q, k, v, g = (x.reshape(B, H, n, C, x.shape[-1]) for x in (q, k, v, g))
    b = b.reshape(B, H, n, C)
    g = g.cumsum(-2)
    dev = q.device
    upper = torch.triu(torch.ones(C, C, dtype=torch.bool, device=dev), 1)
    decay = (g.unsqueeze(-2) - g.unsqueeze(-3)).masked_fill(upper[..., None], float("-inf")).exp()  # [B,H,n,C,C,K]
    kk = torch.einsum("bhnik,bhnjk,bhnijk->bhnij", k, k, decay)
    A = (kk * b.unsqueeze(-1)).masked_fill(~torch.tril(torch.ones(C, C, dtype=torch.bool, device=dev), -1), 0)
    eye = torch.eye(C, device=dev)
    inv = torch.linalg.solve_triangular(eye + A, eye.expand_as(A).contiguous(), upper=False, unitriangular=True)
    u = inv @ (v * b.unsqueeze(-1))
    w = inv @ (k * b.unsqueeze(-1) * g.exp())
    qk = torch.einsum("bhnik,bhnjk,bhnijk->bhnij", q, k, decay)
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(torch.float32)
    outs = []
    for i in range(n):
        gi = g[:, :, i]
        v_new = u[:, :, i] - w[:, :, i] @ S
        outs.append((q[:, :, i] * gi.exp()) @ S + qk[:, :, i] @ v_new)
        S = S * gi[:, :, -1].exp().unsqueeze(-1) + (k[:, :, i] * (gi[:, :, -1:] - gi).exp()).transpose(-1, -2) @ v_new
    o = torch.stack(outs, 2).reshape(B, H, -1, V)[:, :, :T].transpose(1, 2).to(dtype)
    return o, (S if output_final_state else None)


def check_kda() -> float:
    """Max abs difference of `train_chunk_kda` vs transformers' reference on a random fp64 input."""
    from transformers.models.kimi_linear import modeling_kimi_linear as mkl

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 150, 4, 32, generator=gen, dtype=torch.float64) for _ in range(3))
    g = -torch.rand(2, 150, 4, 32, generator=gen, dtype=torch.float64)
    beta = torch.rand(2, 150, 4, generator=gen, dtype=torch.float64)
    ref, _ = mkl.chunk_kimi_delta_attention(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    out, _ = train_chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    return (ref - out).abs().max().item()


def make_model(raw: dict, seed: int, device: torch.device):
    from transformers import KimiLinearConfig, KimiLinearForCausalLM
    from transformers.models.kimi_linear import modeling_kimi_linear as mkl

    mkl.chunk_kimi_delta_attention = train_chunk_kda
    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(KimiLinearConfig(**raw))
    model.set_experts_implementation("eager")
    return model.to(device)


def make_model_eval(model_dir: str | Path):
    """transformers' KimiLinearForCausalLM from a saved checkpoint, fp32, eval mode, with `train_chunk_kda`."""
    from transformers import KimiLinearForCausalLM
    from transformers.models.kimi_linear import modeling_kimi_linear as mkl

    mkl.chunk_kimi_delta_attention = train_chunk_kda
    model = KimiLinearForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, experts_implementation="eager")
    return model.eval()


class RouterBalancer:
    """Aux-loss-free load balancing (DeepSeek-V3): nudge each router's `e_score_correction_bias` toward even load."""

    def __init__(self, model: torch.nn.Module, rate: float) -> None:
        from transformers.models.kimi_linear import modeling_kimi_linear as mkl

        self.rate = rate
        self.loads: dict[torch.nn.Module, torch.Tensor] = {}
        self.routers = [m for m in model.modules() if isinstance(m, mkl.KimiLinearTopkRouter)]
        for r in self.routers:
            r.register_forward_hook(self._hook)

    def _hook(self, module, _inputs, output) -> None:
        idx = output[2].detach().flatten()
        self.loads[module] = torch.bincount(idx, minlength=module.num_experts).float()

    @torch.no_grad()
    def update(self) -> float:
        """Apply the bias step; returns the worst max/mean load ratio of this step."""
        worst = 0.0
        for r, load in self.loads.items():
            r.e_score_correction_bias += self.rate * torch.sign(load.mean() - load)
            worst = max(worst, (load.max() / load.mean().clamp_min(1e-9)).item())
        return worst


# ---------------------------------------------------------------- checkpoint
def save_checkpoint(model, raw: dict, tok_dir: Path, out: Path, generation: dict, meta: dict) -> None:
    """bf16 safetensors in the Kimi Linear names (dense layer 0 as `mlp.*`), config, tokenizer, training metadata."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        names = sorted(Path(tmp).glob("*.safetensors"))
        weights: dict[str, torch.Tensor] = {}
        for f in names:
            weights.update(load_file(str(f)))
    renamed = {}
    for name, t in weights.items():
        for i in range(raw["first_k_dense_replace"]):
            name = name.replace(f"model.layers.{i}.block_sparse_moe.", f"model.layers.{i}.mlp.")
        keep_fp32 = name.endswith(("e_score_correction_bias",))
        renamed[name] = (t.float() if keep_fp32 else t.to(torch.bfloat16)).contiguous()
    save_file(renamed, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {**raw, "torch_dtype": "bfloat16"}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tok_dir / name, out / name)
    (out / "training.json").write_text(json.dumps(meta, indent=2) + "\n")


# ---------------------------------------------------------------- training
def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def masked_losses(logits: torch.Tensor, ids: torch.Tensor, kind: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean next-token cross-entropy over conversation targets and over code targets."""
    logp = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="none")
    k = kind[:, 1:].flatten()
    conv, code = (k == 1).float(), (k == 2).float()
    return (logp * conv).sum() / conv.sum().clamp_min(1), (logp * code).sum() / code.sum().clamp_min(1)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="deltaserve/default_model", help="where the checkpoint is written")
    ap.add_argument("--work", default="/tmp/deltaserve-train-tiny", help="scratch directory (tokenizer, snapshots)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=8, help="rows per step")
    ap.add_argument("--seq-len", type=int, default=640)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--code-weight", type=float, default=0.3, help="weight of the code loss against conversations")
    ap.add_argument("--code-rows", type=float, default=0.2, help="share of rows that are code only")
    ap.add_argument("--conversations", type=int, default=12000)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared 2-core machine)")
    ap.add_argument("--time-limit-min", type=float, default=0, help="stop early (and save) after this many minutes")
    ap.add_argument("--save-every", type=int, default=50)
    ap.add_argument("--time-schedule", action="store_true",
                    help="with --time-limit-min: the lr schedule also advances with wall time, so it completes when "
                         "the time limit stops the run on a slow machine (not deterministic then)")
    ap.add_argument("--synthetic", type=float, default=0.0,
                    help="share of tool tasks with made-up argument values (copy training; see make_tool_data.py)")
    ap.add_argument("--plain-share", type=float, default=0.15, help="share of conversations answered without a tool")
    ap.add_argument("--short-copy", action="store_true",
                    help="copy tasks without tool declarations (short, many per row), half of them JSON lookups")
    ap.add_argument("--copy-share", type=float, default=None,
                    help="share of plain turns that are copy / lookup tasks (default: the --synthetic share)")
    ap.add_argument("--list-share", type=float, default=0.0,
                    help="with --short-copy: share of lookups that copy a whole file list (as file-search answers)")
    ap.add_argument("--neutral-share", type=float, default=0.0,
                    help="share of tool tasks phrased with a tool-neutral template (the value alone names the tool)")
    ap.add_argument("--stop-at-step", type=int, default=0,
                    help="stop (and save) after this many steps, the schedule still set by --steps (0: run them all)")
    ap.add_argument("--init-from", default=None,
                    help="continue from this checkpoint (its weights, config and tokenizer) instead of a fresh model")
    ap.add_argument("--tokenizer-from", default=None,
                    help="reuse this checkpoint's tokenizer (same ids: a draft model) instead of training one")
    ap.add_argument("--hidden", type=int, default=None, help="hidden size (default: SPEC's)")
    ap.add_argument("--layers", type=int, default=None,
                    help="decoder layers (default: SPEC's); every 4th and the last are MLA, the rest KDA")
    ap.add_argument("--intermediate", type=int, default=None, help="dense FFN width (default: SPEC's)")
    ap.add_argument("--dense", action="store_true", help="every layer a dense FFN (no MoE)")
    ap.add_argument("--check-kda", action="store_true", help="compare the training KDA with the reference and exit")
    return ap.parse_args()


def main() -> None:  # noqa: PLR0915 - a linear script
    args = parse_args()
    torch.set_num_threads(args.threads)
    if args.check_kda:
        print(f"train_chunk_kda vs reference: max abs diff {check_kda():.3e}")
        return
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.time()
    work = Path(args.work)
    tok_dir = work / "tokenizer"
    code_texts = read_code("train", CODE_CHARS)
    if args.init_from:  # stage 2: keep the checkpoint's tokenizer and config
        tok_dir.mkdir(parents=True, exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
            shutil.copy(Path(args.init_from) / name, tok_dir / name)
        raw = json.loads((tok_dir / "config.json").read_text())
        special = {k: raw[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    else:
        spec = dataclasses.replace(SPEC, **{k: v for k, v in (("hidden", args.hidden), ("layers", args.layers),
                                                             ("intermediate", args.intermediate)) if v is not None})
        if args.dense:
            spec = dataclasses.replace(spec, first_k_dense=spec.layers)
        if args.tokenizer_from:  # a draft: the target's tokenizer, so its token ids are the target's
            tok_dir.mkdir(parents=True, exist_ok=True)
            for name in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(Path(args.tokenizer_from) / name, tok_dir / name)
            source = json.loads((Path(args.tokenizer_from) / "config.json").read_text())
            special = {k: source[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        else:
            special = build_tokenizer(tok_dir, code_texts, args.seed)
        raw = tiny_config_dict(spec, special)
        raw["model_max_length"] = MAX_LEN
        (tok_dir / "config.json").write_text(json.dumps(raw, indent=2) + "\n")  # lets get_chat_format pick kimi_k2
    tok = Tokenizer.from_pretrained(tok_dir)
    fmt = get_chat_format(tok_dir, tok)
    convs = [render_example(fmt, c)
             for c in make_conversations("train", args.conversations, args.seed, synthetic=args.synthetic,
                                         plain_share=args.plain_share, short_copy=args.short_copy,
                                         copy_share=args.copy_share, list_share=args.list_share,
                                         neutral_share=args.neutral_share)]
    code = tokenize_code(tok_dir, code_texts)
    lens = [len(c[0]) for c in convs]
    print(f"data: {len(convs)} conversations (mean {sum(lens) / len(lens):.0f} tokens, max {max(lens)}), "
          f"{len(code)} code tokens from {len(code_texts)} files; prep {time.time() - t0:.0f}s", flush=True)
    batches = Batches(convs, code, args.seq_len, args.seed, args.code_rows)
    if args.init_from:
        model = make_model_eval(args.init_from).to(device)
        print(f"initialised from {args.init_from}", flush=True)
    else:
        model = make_model(raw, args.seed, device)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters on {device}, {args.threads} threads", flush=True)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    balancer = RouterBalancer(model, rate=1e-3)
    generation = {
        "bos_token_id": special["bos_token_id"],
        "eos_token_id": [special["eos_token_id"], tok.special_tokens["[EOS]"]],
        "pad_token_id": special["pad_token_id"],
    }
    meta = {"seed": args.seed, "args": vars(args), "spec": SPEC.__class__.__name__, "parameters": n_params,
            "log": []}
    if args.init_from:  # keep the earlier stages' records: the checkpoint's history is all of them
        meta["previous_stage"] = json.loads((Path(args.init_from) / "training.json").read_text())
    t_train = time.time()
    tokens = 0
    step = 0
    for step in range(args.steps):
        sched_step = step
        if args.time_schedule and args.time_limit_min:
            sched_step = max(step, int((time.time() - t_train) / (args.time_limit_min * 60) * args.steps))
        for group in opt.param_groups:
            group["lr"] = lr_at(sched_step, args.steps, args.lr, args.warmup)
        ids, kind = batches.batch(args.batch)
        ids, kind = ids.to(device), kind.to(device)
        logits = model(input_ids=ids).logits
        loss_conv, loss_code = masked_losses(logits, ids, kind)
        loss = loss_conv + args.code_weight * loss_code
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        imbalance = balancer.update()
        tokens += ids.numel()
        elapsed = time.time() - t_train
        if step % 5 == 0 or step == args.steps - 1:
            entry = {"step": step, "conv_loss": round(loss_conv.item(), 4), "code_loss": round(loss_code.item(), 4),
                     "tok_s": round(tokens / elapsed), "elapsed_s": round(elapsed), "imbalance": round(imbalance, 2)}
            meta["log"].append(entry)
            eta = elapsed / (step + 1) * (args.steps - step - 1)
            print(f"step {step:4d}/{args.steps} conv {loss_conv.item():.3f} code {loss_code.item():.3f} "
                  f"lr {opt.param_groups[0]['lr']:.2e} {tokens / elapsed:.0f} tok/s "
                  f"elapsed {elapsed / 60:.1f}m eta {eta / 60:.1f}m imbalance {imbalance:.2f}", flush=True)
        stop = (args.time_limit_min and elapsed > args.time_limit_min * 60) or step + 1 == args.stop_at_step
        if (step + 1) % args.save_every == 0 or stop:
            meta.update(steps_done=step + 1, train_seconds=round(elapsed), tokens=tokens)
            save_checkpoint(model, raw, tok_dir, Path(args.out), generation, meta)
            print(f"saved {args.out} at step {step + 1}", flush=True)
        if stop:
            print(f"time limit reached after {step + 1} steps", flush=True)
            break
    else:
        meta.update(steps_done=args.steps, train_seconds=round(time.time() - t_train), tokens=tokens)
        save_checkpoint(model, raw, tok_dir, Path(args.out), generation, meta)
        print(f"done: {args.steps} steps, {tokens} tokens, {(time.time() - t_train) / 60:.1f} min; saved {args.out}")


if __name__ == "__main__":
    main()
