"""Model-level invariants through the runner: chunked == one-shot, prefill + decode == full, batched == alone."""

from __future__ import annotations

import pytest
import torch

from deltaserve.models.loader import load_model
from deltaserve.runner.model_runner import ModelRunner
from deltaserve.scheduler.output import ScheduledChunk
from tests.helpers import full_logits, prompt_ids, relative_error

# The perturbed tiny model amplifies rounding: transformers' own cached-vs-full fp32 gap on it is 2e-5 relative.
# fp64 runs (the KDA ops still accumulate in fp32) make the same checks ~50x tighter.
TOL = {torch.float32: 1e-4, torch.float64: 2e-6}


@pytest.fixture(scope="module", params=[torch.float32, torch.float64], ids=["fp32", "fp64"])
def model(tiny_dir, request):
    return load_model(tiny_dir("base"), dtype=request.param)


def run_in_pieces(model, ids: list[int], pieces: list[int], slot: int = 0) -> torch.Tensor:
    """Feed `ids` in consecutive chunks of the given sizes; return the last-token logits of every chunk."""
    runner = ModelRunner(model, num_blocks=8, block_size=16, num_slots=3)
    blocks, done, out = [6, 2, 7, 0, 5], 0, []
    for n in pieces:
        chunk = ScheduledChunk(
            request_id="r",
            new_token_ids=ids[done : done + n],
            num_computed_tokens=done,
            state_slot=slot,
            block_ids=blocks,
            reset_state=done == 0,
        )
        out.append(runner.execute_model([chunk])[0])
        done += n
    return torch.stack(out)


def test_chunked_prefill_equals_one_shot(model):
    """Prefill in chunks of 17, 16, 1, 30 tokens gives the one-shot logits at each chunk end."""
    ids = prompt_ids(1024, 64, seed=1)
    ref = full_logits(model, ids)
    pieces = [17, 16, 1, 30]
    ends = torch.tensor(pieces).cumsum(0) - 1
    assert relative_error(run_in_pieces(model, ids, pieces), ref[ends]) < TOL[model.dtype]


def test_prefill_then_decode_equals_full_forward(model):
    """Prefill 30 tokens then 20 single-token decode steps equals one forward over all 50."""
    ids = prompt_ids(1024, 50, seed=2)
    ref = full_logits(model, ids)
    out = run_in_pieces(model, ids, [30] + [1] * 20)
    assert relative_error(out, ref[29:]) < TOL[model.dtype]


def test_mixed_batch_equals_each_alone(model):
    """One step holding two decodes and two prefill chunks gives each sequence's logits as if run alone."""
    seqs = [prompt_ids(1024, n, seed=10 + n) for n in (9, 20, 5, 33)]
    alone = [full_logits(model, s) for s in seqs]
    runner = ModelRunner(model, num_blocks=24, block_size=4, num_slots=4)
    tables = [[0, 4, 8], [1, 5, 9, 12, 13], [2, 6], [3, 7, 10, 11, 14, 15, 16, 17, 18]]  # disjoint, scattered
    # Warm sequences 0 and 1 with all but their last token, so their last token is a decode row.
    runner.execute_model(
        [
            ScheduledChunk(
                request_id="r",
                new_token_ids=seqs[0][:-1],
                num_computed_tokens=0,
                state_slot=2,
                block_ids=tables[0],
                reset_state=True,
            ),
            ScheduledChunk(
                request_id="r",
                new_token_ids=seqs[1][:-1],
                num_computed_tokens=0,
                state_slot=0,
                block_ids=tables[1],
                reset_state=True,
            ),
        ]
    )
    chunks = [
        ScheduledChunk(
            request_id="r",
            new_token_ids=seqs[3],
            num_computed_tokens=0,
            state_slot=1,
            block_ids=tables[3],
            reset_state=True,
        ),
        ScheduledChunk(
            request_id="r", new_token_ids=seqs[0][-1:], num_computed_tokens=8, state_slot=2, block_ids=tables[0]
        ),
        ScheduledChunk(
            request_id="r",
            new_token_ids=seqs[2],
            num_computed_tokens=0,
            state_slot=3,
            block_ids=tables[2],
            reset_state=True,
        ),
        ScheduledChunk(
            request_id="r", new_token_ids=seqs[1][-1:], num_computed_tokens=19, state_slot=0, block_ids=tables[1]
        ),
    ]
    out = runner.execute_model(chunks)
    for row, seq in zip(out, [3, 0, 2, 1], strict=True):
        assert relative_error(row, alone[seq][-1]) < TOL[model.dtype], f"sequence {seq}"


def test_kda_checkpoints_equal_states_of_a_shorter_prefill(model):
    """Checkpoints saved inside one prefill (state and conv window) equal the slot of a prefill that stops there."""
    ids = prompt_ids(1024, 50, seed=4)
    runner = ModelRunner(model, num_blocks=8, block_size=16, num_slots=5)
    positions = (16, 32, 37, 50)
    chunk = ScheduledChunk(request_id="r", new_token_ids=ids, num_computed_tokens=0, state_slot=0,
                           block_ids=list(range(4)), reset_state=True,
                           checkpoints=tuple((p, 1 + i) for i, p in enumerate(positions)))
    runner.execute_model([chunk])
    for i, pos in enumerate(positions):
        short = ModelRunner(model, num_blocks=8, block_size=16, num_slots=1)
        short.execute_model([ScheduledChunk(request_id="s", new_token_ids=ids[:pos], num_computed_tokens=0,
                                            state_slot=0, block_ids=list(range(4)), reset_state=True)])
        for layer_id in model.config.kda_layer_ids:
            ours, ref = runner.caches[layer_id], short.caches[layer_id]
            assert relative_error(ours.state[1 + i], ref.state[0]) < TOL[model.dtype], (layer_id, pos)
            assert relative_error(ours.conv[1 + i], ref.conv[0]) < TOL[model.dtype], (layer_id, pos)
