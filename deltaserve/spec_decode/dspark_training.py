"""Training a block drafter (`models/dspark.py`) on the target's own sequences: its features, the training blocks and
the loss. Used by `scripts/train_dspark.py` (the embedded model's drafter) and by tests (drafters for tiny
checkpoints).

An anchor N of a sequence x_0..x_{L-1} is a training block: context = the target's taps at positions N - W .. N - 1,
block = [x_N, MASK x k], targets = x_{N+1} .. x_{N+k} (padding past the end). At serving time N is the position of
the token the target just sampled, so anchors are taken in the generated part (N >= the prompt length).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deltaserve.models.dspark import DSparkConfig, DSparkDrafter, position_weights
from deltaserve.models.protocol import Model
from deltaserve.runner.feature_taps import FeatureTaps
from deltaserve.runner.model_runner import ModelRunner
from deltaserve.scheduler.output import ScheduledChunk

IGNORE = -100
"""Target id of padding rows (past the end of a sequence): no loss."""


@dataclass(frozen=True, slots=True)
class FeatureSequence:
    """One sequence's tokens and target taps from position `offset` on (the last W prompt positions and after)."""

    token_ids: torch.Tensor
    """int64 [n]: tokens offset .. L - 1."""
    features: torch.Tensor
    """[n, feature_size] (bf16 to save memory): the taps at those positions."""
    first_anchor: int
    """Index (into `token_ids`) of the first anchor: the prompt's length minus `offset`."""

    def anchors(self) -> range:
        """Indices N with at least one target token after them."""
        return range(self.first_anchor, len(self.token_ids) - 1)


@torch.inference_mode()
def sequence_features(model: Model, sequences: Sequence[tuple[list[int], int]], tap_layers: Sequence[int],
                      window: int, *, progress_every: int = 0) -> list[FeatureSequence]:
    """(tokens, prompt length) pairs -> their taps, one prefill forward each through a `ModelRunner` (the forward
    the engine runs). `progress_every`: print a line every that many sequences (0: quiet)."""
    longest = max(len(s) for s, _ in sequences)
    block = 16
    runner = ModelRunner(model, num_blocks=math.ceil(longest / block) + 1, block_size=block, num_slots=1,
                         max_num_tokens=longest)
    taps = FeatureTaps(model, tap_layers)
    out = []
    try:
        for n, (ids, prompt_len) in enumerate(sequences):
            chunk = ScheduledChunk(request_id="features", new_token_ids=list(ids), num_computed_tokens=0,
                                   state_slot=0, block_ids=list(range(math.ceil(len(ids) / block))),
                                   reset_state=True)
            runner.execute_model([chunk])
            first = max(0, prompt_len - window)
            out.append(FeatureSequence(torch.tensor(ids[first:]), taps.take()[first:].to(torch.bfloat16),
                                       prompt_len - first))
            if progress_every and n % progress_every == 0:
                print(f"features {n}/{len(sequences)}", flush=True)
    finally:
        taps.remove()
    return out


def training_batch(sequences: Sequence[FeatureSequence], anchors: Sequence[tuple[int, int]], cfg: DSparkConfig
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sequence, anchor) pairs -> (features [A, W, F] fp32, valid [A, W], first tokens [A], targets [A, k] with
    IGNORE past the end)."""
    w, k = cfg.context_window, cfg.block_size
    feats = torch.zeros(len(anchors), w, cfg.feature_size)
    valid = torch.zeros(len(anchors), w, dtype=torch.bool)
    first = torch.empty(len(anchors), dtype=torch.long)
    targets = torch.full((len(anchors), k), IGNORE, dtype=torch.long)
    for a, (s, n) in enumerate(anchors):
        seq = sequences[s]
        lo = max(0, n - w)
        feats[a, w - (n - lo):] = seq.features[lo:n].float()
        valid[a, w - (n - lo):] = True
        first[a] = seq.token_ids[n]
        tail = seq.token_ids[n + 1:n + 1 + k]
        targets[a, :len(tail)] = tail
    return feats, valid, first, targets


def drafter_loss(drafter: DSparkDrafter, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                 embed_weight: torch.Tensor, head_weight: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, correct [A, k], real [A, k]): the position-weighted cross-entropy of the block's targets through the
    target's frozen embedding and LM head (fp32 weights), and which rows' argmax is the target."""
    feats, valid, first, targets = batch
    hidden = drafter(feats, valid, F.embedding(first, embed_weight))
    logits = hidden @ head_weight.T  # [A, k, V]
    ce = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=IGNORE, reduction="none")  # [A, k]
    real = targets != IGNORE
    weights = position_weights(drafter.config.block_size) * real
    loss = (ce * weights).sum() / weights.sum().clamp_min(1e-9)
    return loss, (logits.argmax(-1) == targets) & real, real


def acceptance_length(correct: torch.Tensor) -> float:
    """Greedy acceptance length of blocks: 1 (the token every step samples) + the drafts right before the first
    wrong one, averaged."""
    return 1.0 + correct.int().cumprod(dim=1).sum(dim=1).float().mean().item()


def fit(drafter: DSparkDrafter, sequences: Sequence[FeatureSequence], embed: torch.Tensor, head: torch.Tensor,
        steps: int, lr: float = 3e-3) -> tuple[torch.Tensor, torch.Tensor]:
    """`steps` AdamW steps on every anchor of `sequences` at once (small fits: tests' drafters for tiny
    checkpoints), through the target's fp32 embedding and LM head weights; returns the final (correct [A, k],
    real [A, k]) of those anchors."""
    batch = training_batch(sequences, [(s, n) for s, seq in enumerate(sequences) for n in seq.anchors()],
                           drafter.config)
    opt = torch.optim.AdamW(drafter.parameters(), lr=lr)
    for _ in range(steps):
        loss, _, _ = drafter_loss(drafter, batch, embed, head)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        _, correct, real = drafter_loss(drafter, batch, embed, head)
    return correct, real
