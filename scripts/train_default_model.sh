#!/usr/bin/env bash
# Rebuild the embedded default model (deltaserve/default_model/) from nothing in one run: tokenizer, data and
# 3,300 training steps (12.7M tokens; 51-55 minutes with 2 threads on a 2-core AMD EPYC at 3,900-4,150 tokens/s).
# Deterministic for this seed and thread count. See deltaserve/default_model/MODEL_CARD.md for the data mix and
# what came out; the seven-stage chain that built the previous release is in git history (commit 876ca8b).
set -euo pipefail
WORK=${WORK:-/tmp/deltaserve-default-model}
OUT=${OUT:-deltaserve/default_model}

# --synthetic: made-up argument values (only copying them works); --plain-share / --copy-share: 65% of the
# conversations are answered without a tool, 70% of those are short copy tasks (--short-copy: no tool declarations,
# half of them lookups in a JSON object, --list-share: half of those whole file lists); --neutral-share: 30% of the
# tool questions use words shared by every tool, so the value alone tells which tool is meant.
python scripts/train_tiny.py --out "$OUT" --work "$WORK" --seed 0 --steps 3300 --batch 6 --lr 3e-3 --warmup 30 \
    --conversations 100000 --synthetic 0.9 --plain-share 0.65 --copy-share 0.7 --short-copy --list-share 0.5 \
    --neutral-share 0.3 --code-rows 0.1 --threads 2 --save-every 100
