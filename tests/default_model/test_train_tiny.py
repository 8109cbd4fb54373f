"""`scripts/train_tiny.py` end to end on a few steps: it shows progress, writes a loadable Kimi Linear checkpoint with
its training record, and is deterministic for a seed (two runs give byte-identical weights)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from deltaserve.default_model import default_model_dir

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_tiny.py"


def _train(tmp: Path, name: str, seed: int) -> tuple[Path, str]:
    out = tmp / name
    cmd = [sys.executable, str(SCRIPT), "--init-from", str(default_model_dir()), "--out", str(out), "--work",
           str(tmp / f"work-{name}"), "--seed", str(seed), "--steps", "3", "--batch", "2", "--seq-len", "128",
           "--conversations", "200", "--synthetic", "0.9", "--plain-share", "0.6", "--short-copy", "--list-share",
           "0.5", "--neutral-share", "0.3", "--lr", "1e-3", "--warmup", "1", "--threads", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stdout


@pytest.mark.slow  # CI time: the training script, not the server
def test_few_steps_are_deterministic_and_show_progress(tmp_path: Path):
    a, log = _train(tmp_path, "a", seed=3)
    b, _ = _train(tmp_path, "b", seed=3)
    c, _ = _train(tmp_path, "c", seed=4)
    assert "data: 200 conversations" in log and "tok/s" in log and "step    0/3" in log and "done: 3 steps" in log
    wa, wb, wc = (load_file(str(d / "model.safetensors")) for d in (a, b, c))
    base = load_file(str(default_model_dir() / "model.safetensors"))
    assert wa.keys() == wb.keys() == base.keys()
    assert all((wa[k] == wb[k]).all() for k in wa)  # same seed: identical weights
    assert any((wa[k] != base[k]).any() for k in wa)  # the steps changed something
    assert any((wa[k] != wc[k]).any() for k in wa)  # another seed: other data, other weights
    meta = json.loads((a / "training.json").read_text())
    assert meta["steps_done"] == 3 and meta["args"]["neutral_share"] == 0.3 and "previous_stage" in meta
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (a / name).is_file()
