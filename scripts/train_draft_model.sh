#!/usr/bin/env bash
# Train the draft model of the embedded default model (deltaserve/default_model/draft/) in one run: the default
# model's tokenizer (same token ids, so it can propose tokens for speculative decoding), the same data mix, flags and
# seed as scripts/train_default_model.sh, and a 2-layer dense shape (1 KDA + 1 MLA layer, hidden 128, no MoE:
# about 30% of the target's decode step on CPU). A fixed wall budget: --time-limit-min stops it (and saves) after 40
# minutes of training, and --time-schedule advances the lr schedule (set for 3,000 steps) with wall time too, so
# it decays fully within the budget however busy the machine is (so the run is not deterministic).
# See deltaserve/default_model/draft/MODEL_CARD.md.
set -euo pipefail
WORK=${WORK:-/tmp/deltaserve-draft-model}
OUT=${OUT:-deltaserve/default_model/draft}

python scripts/train_tiny.py --out "$OUT" --work "$WORK" --seed 0 --steps 3000 --batch 6 --lr 3e-3 --warmup 30 \
    --conversations 20000 --synthetic 0.9 --plain-share 0.65 --copy-share 0.7 --short-copy --list-share 0.5 \
    --neutral-share 0.3 --code-rows 0.1 --threads 1 --save-every 100 --time-limit-min 27 --time-schedule \
    --tokenizer-from deltaserve/default_model --hidden 128 --layers 2 --dense
