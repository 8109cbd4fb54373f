"""`DSparkDrafter`: a block drafter (DSpark / DFlash style) that proposes a whole block of tokens in one forward.

Conditioned on the target's hidden states ("feature taps": the outputs of a few target decoder layers, concatenated)
at the last `context_window` computed positions, it reads a block ``[t_N, MASK, ..., MASK]`` (the target's last
sampled token, then `block_size` mask rows) and predicts ``t_{N+1} .. t_{N+block_size}`` at the mask rows, all at
once. Attention is non-causal: every block row sees every context row and every other block row, so drafting cost
is one small forward whatever the block depth. Each layer's keys and values are the context rows (the projected
taps, its own small KV, recomputed per block) and the block rows; queries are the block rows only.

The drafter shares the target's token embedding and LM head (frozen, not in its checkpoint): its hidden size is the
target's. Its checkpoint is a directory with `config.json` (`DSparkConfig` fields) and `model.safetensors`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from deltaserve.default_model import DSPARK_PATH, default_model_dir

ARCHITECTURE = "DSparkDrafter"


@dataclass(frozen=True, slots=True, kw_only=True)
class DSparkConfig:
    """The drafter's shape (its `config.json`)."""

    vocab_size: int
    hidden_size: int
    """The target's hidden size (the drafter reads the target's embedding and LM head)."""
    tap_layers: tuple[int, ...]
    """0-based target decoder layers whose outputs are the conditioning features, in order."""
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 384
    block_size: int = 7
    """Most tokens drafted per forward (mask rows after the known token)."""
    context_window: int = 16
    """Target positions (features) each block attends to: the last ones before the block."""
    rms_norm_eps: float = 1e-5
    architectures: tuple[str, ...] = (ARCHITECTURE,)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size", "block_size",
                     "context_window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"dspark config.{name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"dspark config.hidden_size {self.hidden_size} is not a multiple of num_heads "
                             f"{self.num_heads}")
        if not self.tap_layers or any(not isinstance(i, int) or i < 0 for i in self.tap_layers):
            raise ValueError(f"dspark config.tap_layers must be non-empty 0-based layer indices, got "
                             f"{self.tap_layers!r}")

    @property
    def feature_size(self) -> int:
        """Width of one position's features: one target hidden state per tap."""
        return self.hidden_size * len(self.tap_layers)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> DSparkConfig:
        """Read `config.json` of a drafter checkpoint; ValueError naming the field for a bad one."""
        file = Path(path) / "config.json"
        try:
            raw = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"speculative_config.model {str(path)!r}: cannot read {file.name}: {e}") from e
        if ARCHITECTURE not in raw.get("architectures", ()):
            raise ValueError(f"speculative_config.model {str(path)!r} is not a {ARCHITECTURE} checkpoint "
                             f"(architectures {raw.get('architectures')!r})")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"dspark config has unknown fields {unknown}")
        raw["tap_layers"] = tuple(raw["tap_layers"])
        raw["architectures"] = tuple(raw["architectures"])
        return cls(**raw)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


class _Layer(nn.Module):
    """Pre-norm attention (block queries over context + block keys) and a SiLU-gated MLP."""

    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.num_heads, self.eps = cfg.num_heads, cfg.rms_norm_eps
        self.attn_norm = nn.Parameter(torch.ones(d))
        self.ctx_norm = nn.Parameter(torch.ones(d))
        self.q = nn.Linear(d, d, bias=False)
        self.kv = nn.Linear(d, 2 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(d))
        self.gate_up = nn.Linear(d, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, d, bias=False)

    def forward(self, block: torch.Tensor, ctx: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        """block [B, L, d], ctx [B, W, d], key_mask [B, 1, 1, W + L] (True: attend) -> block [B, L, d]."""
        b, n, d = block.shape
        h = self.num_heads
        x = F.rms_norm(block, (d,), self.attn_norm, self.eps)
        src = torch.cat([F.rms_norm(ctx, (d,), self.ctx_norm, self.eps), x], dim=1)
        q = self.q(x).view(b, n, h, d // h).transpose(1, 2)
        k, v = self.kv(src).view(b, src.shape[1], 2, h, d // h).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        block = block + self.o(att.transpose(1, 2).reshape(b, n, d))
        gate, up = self.gate_up(F.rms_norm(block, (d,), self.mlp_norm, self.eps)).chunk(2, dim=-1)
        return block + self.down(F.silu(gate) * up)


class DSparkDrafter(nn.Module):
    """The block drafter's own weights (the embedding and LM head are the target's, passed to `forward`)."""

    def __init__(self, cfg: DSparkConfig) -> None:
        super().__init__()
        self.config = cfg
        d = cfg.hidden_size
        self.fc = nn.Linear(cfg.feature_size, d, bias=False)
        self.fc_norm = nn.Parameter(torch.ones(d))
        self.mask_embedding = nn.Parameter(torch.zeros(d))
        self.position_embedding = nn.Parameter(torch.zeros(cfg.context_window + 1 + cfg.block_size, d))
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(d))

    def forward(self, features: torch.Tensor, valid: torch.Tensor, first_embeds: torch.Tensor,
                num_drafts: int | None = None) -> torch.Tensor:
        """Hidden states of the drafted positions, final-normed for the target's LM head.

        Args:
            features: ``[B, W, feature_size]`` the taps at the W positions before the block, oldest first
                (W = `context_window`; rows without features are padding).
            valid: ``[B, W]`` bool, False for padding rows (a row may have none valid).
            first_embeds: ``[B, d]`` the target's embedding of each block's known first token.
            num_drafts: mask rows to run (default `block_size`).

        Returns:
            ``[B, num_drafts, d]``: row j predicts the token j + 1 positions after the known one.
        """
        cfg = self.config
        n = cfg.block_size if num_drafts is None else num_drafts
        b, w, _ = features.shape
        if w != cfg.context_window or not 1 <= n <= cfg.block_size:
            raise ValueError(f"dspark forward: context {w} (want {cfg.context_window}), drafts {n} "
                             f"(want 1..{cfg.block_size})")
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        pos = self.position_embedding
        ctx = F.rms_norm(self.fc(features), (d,), self.fc_norm, eps) + pos[:w]
        block = torch.cat([first_embeds[:, None, :], self.mask_embedding.expand(b, n, d)], dim=1) + pos[w:w + 1 + n]
        key_mask = torch.cat([valid, valid.new_ones(b, 1 + n)], dim=1)[:, None, None, :]
        for layer in self.layers:
            block = layer(block, ctx, key_mask)
        return F.rms_norm(block[:, 1:], (d,), self.norm, eps)

    def init_for_training(self) -> DSparkDrafter:
        """Projection weights ~ N(0, 0.02) (the default uniform init of `nn.Linear` trains slower), embeddings and
        norms as built (zeros, ones). Uses torch's global generator; returns self."""
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    module.weight.normal_(std=0.02)
        return self

    def save(self, out: str | Path) -> None:
        """Write `config.json` and `model.safetensors` (bf16) into the directory `out`."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(self.config.to_json() + "\n")
        save_file({k: v.detach().to(torch.bfloat16).contiguous() for k, v in self.state_dict().items()},
                  str(out / "model.safetensors"))


def load_drafter(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
                 ) -> DSparkDrafter:
    """A drafter checkpoint directory -> the drafter in eval mode, in `dtype` on `device`. ValueError naming the
    checkpoint when a tensor is missing, unknown or of the wrong shape."""
    cfg = DSparkConfig.from_pretrained(path)
    drafter = DSparkDrafter(cfg)
    weights = load_file(str(Path(path) / "model.safetensors"))
    own = drafter.state_dict()
    if set(weights) != set(own) or any(weights[k].shape != own[k].shape for k in own):
        missing, unknown = sorted(set(own) - set(weights))[:3], sorted(set(weights) - set(own))[:3]
        raise ValueError(f"speculative_config.model {str(path)!r}: its tensors do not match its config.json "
                         f"(missing {missing}, unknown {unknown}, or shapes differ)")
    drafter.load_state_dict(weights)
    return drafter.to(device=device, dtype=dtype).eval().requires_grad_(False)


def drafter_weight_bytes(cfg: DSparkConfig, element_size: int) -> int:
    """Bytes of the drafter's own weights at `element_size` bytes per value (counted on the meta device)."""
    with torch.device("meta"):
        return sum(p.numel() for p in DSparkDrafter(cfg).parameters()) * element_size


def request_bytes(cfg: DSparkConfig, element_size: int) -> int:
    """Bytes one request holds on a worker: its feature window (`element_size` bytes per value) and its kept fp32
    draft distributions (one per block row)."""
    return cfg.context_window * cfg.feature_size * element_size + cfg.block_size * cfg.vocab_size * 4


def draft_logits(drafter: Callable[..., torch.Tensor], features: torch.Tensor, valid: torch.Tensor,
                 first_tokens: torch.Tensor, embed: Callable[[torch.Tensor], torch.Tensor],
                 lm_head: Callable[[torch.Tensor], torch.Tensor], num_drafts: int | None = None) -> torch.Tensor:
    """fp32 draft logits ``[B, num_drafts, vocab]`` through the target's embedding and LM head callables; `drafter`
    is a `DSparkDrafter` or anything called as one (its compiled graphs)."""
    hidden = drafter(features, valid, embed(first_tokens), num_drafts)
    b, n, d = hidden.shape
    return lm_head(hidden.reshape(b * n, d)).float().view(b, n, -1)


def position_weights(block_size: int, decay: float = 7.0) -> torch.Tensor:
    """Training loss weight of each block row: exp(-(j - 1) / decay), as DFlash (early rows matter most: a draft
    is accepted only while every row before it is)."""
    return torch.tensor([math.exp(-j / decay) for j in range(block_size)])


def resolve_drafter_path(model: str | None, target: str | Path) -> Path:
    """The drafter checkpoint of speculative method dspark: `model` when given, else the embedded model's own
    drafter when `target` is the embedded model. ValueError naming the field otherwise."""
    if model is not None:
        return Path(model)
    if Path(target).resolve() == default_model_dir().resolve() and DSPARK_PATH.is_dir():
        return DSPARK_PATH
    raise ValueError("speculative_config.model is required for method 'dspark' (only the embedded default model "
                     "ships a block drafter)")
