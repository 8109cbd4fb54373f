"""Benchmark the deltaserve model core against transformers on one tiny checkpoint (CPU): prefill and decode.

Prints medians and the speed ratio (transformers time / deltaserve time; > 1 means deltaserve is faster).
Usage: python scripts/bench_model_core.py [--model DIR] [--prefill-lens 64,256,1024] [--decode-steps 32]
Without --model a default tiny checkpoint (model-spec §13.1 sizes) is written to a temporary directory.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import transformers

from deltaserve.models.loader import load_model
from deltaserve.models.tiny import TinySpec, write_tiny_checkpoint
from deltaserve.runner.model_runner import ModelRunner
from deltaserve.scheduler.output import ScheduledChunk


def timed(fn, repeats: int) -> float:
    """Median wall time of fn() over `repeats` runs after one warm-up run."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def ours_prefill(runner: ModelRunner, ids: list[int]):
    blocks = list(range(runner.num_blocks))
    return lambda: runner.execute_model(
        [
            ScheduledChunk(
                request_id="r",
                new_token_ids=ids,
                num_computed_tokens=0,
                state_slot=0,
                block_ids=blocks,
                reset_state=True,
            )
        ]
    )


def ours_decode_step_time(runner: ModelRunner, ids: list[int], steps: int) -> float:
    blocks = list(range(runner.num_blocks))
    ours_prefill(runner, ids)()
    times, token = [], ids[-1]
    for i in range(steps):
        start = time.perf_counter()
        logits = runner.execute_model(
            [
                ScheduledChunk(
                    request_id="r",
                    new_token_ids=[token],
                    num_computed_tokens=len(ids) + i,
                    state_slot=0,
                    block_ids=blocks,
                )
            ]
        )
        token = int(logits[0].argmax())
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def hf_prefill(model, ids: list[int]):
    x = torch.tensor([ids])
    return lambda: model(x, use_cache=True)


def hf_decode_step_time(model, ids: list[int], steps: int) -> float:
    out = model(torch.tensor([ids]), use_cache=True)
    cache, token, times = out.cache, int(out.logits[0, -1].argmax()), []
    for _ in range(steps):
        start = time.perf_counter()
        out = model(torch.tensor([[token]]), cache=cache, use_cache=True)
        cache, token = out.cache, int(out.logits[0, -1].argmax())
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint directory (default: a fresh tiny checkpoint)")
    parser.add_argument("--prefill-lens", default="64,256,1024")
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    path = args.model or write_tiny_checkpoint(tempfile.mkdtemp(prefix="ds-bench-"), TinySpec())
    print(f"checkpoint {path}, dtype {args.dtype}, torch threads {torch.get_num_threads()}")
    ours = load_model(path, dtype=dtype)
    hf = transformers.KimiLinearForCausalLM.from_pretrained(path, dtype=dtype).eval()
    lens = [int(n) for n in args.prefill_lens.split(",")]
    runner = ModelRunner(ours, num_blocks=(max(lens) + args.decode_steps) // 16 + 2, block_size=16, num_slots=1)
    gen = torch.Generator().manual_seed(0)
    vocab = ours.config.vocab_size - 32
    print(f"{'workload':<22}{'transformers ms':>16}{'deltaserve ms':>15}{'speedup':>9}")
    with torch.inference_mode():
        for n in lens:
            ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
            t_hf = timed(hf_prefill(hf, ids), args.repeats)
            t_ds = timed(ours_prefill(runner, ids), args.repeats)
            print(f"{'prefill ' + str(n):<22}{t_hf * 1e3:>16.1f}{t_ds * 1e3:>15.1f}{t_hf / t_ds:>8.2f}x", flush=True)
        ids = torch.randint(0, vocab, (64,), generator=gen).tolist()
        t_hf = hf_decode_step_time(hf, ids, args.decode_steps)
        t_ds = ours_decode_step_time(runner, ids, args.decode_steps)
        print(f"{'decode step (ctx 64)':<22}{t_hf * 1e3:>16.2f}{t_ds * 1e3:>15.2f}{t_hf / t_ds:>8.2f}x")


if __name__ == "__main__":
    main()
