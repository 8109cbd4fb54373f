#!/usr/bin/env bash
# Rebuild the embedded default model (deltaserve/default_model/) from nothing: the seven training stages, in order,
# each continuing from the previous one. Deterministic for these seeds and thread counts (about 2.8 h on a 2-core CPU).
# See deltaserve/default_model/MODEL_CARD.md for what each stage is for and what came out.
set -euo pipefail
WORK=${WORK:-/tmp/deltaserve-default-model}
OUT=${OUT:-deltaserve/default_model}
train() { python scripts/train_tiny.py "$@"; }

# 1. From scratch: the chat and tool-call format, tool choice, Python code (45 min, 1 thread).
train --out "$WORK/stage1" --work "$WORK/w1" --seed 0 --steps 600 --batch 6 --save-every 50
# 2. Made-up argument values, so that values can only be copied, not memorised (250 of 760 scheduled steps).
train --init-from "$WORK/stage1" --out "$WORK/stage2" --work "$WORK/w2" --seed 1 --steps 760 --stop-at-step 250 \
    --batch 6 --lr 2e-3 --warmup 20 --conversations 20000 --synthetic 0.7 --code-rows 0.1 --save-every 50
# 3. Plus copy tasks ("Repeat after me: X") among the plain turns (400 of 800 scheduled steps).
train --init-from "$WORK/stage2" --out "$WORK/stage3" --work "$WORK/w3" --seed 2 --steps 800 --stop-at-step 400 \
    --batch 6 --lr 2e-3 --warmup 20 --conversations 24000 --synthetic 0.7 --plain-share 0.3 --code-rows 0.1 \
    --save-every 50
# 4. Dense copy training: short copy and JSON-lookup turns without tool declarations, many to a row (2 threads).
train --init-from "$WORK/stage3" --out "$WORK/stage4" --work "$WORK/w4" --seed 3 --steps 700 --batch 6 --lr 2e-3 \
    --warmup 20 --conversations 40000 --synthetic 0.9 --plain-share 0.8 --short-copy --code-rows 0.1 --threads 2 \
    --save-every 50
# 5. The same mix with more tool tasks.
train --init-from "$WORK/stage4" --out "$WORK/stage5" --work "$WORK/w5" --seed 4 --steps 550 --batch 6 --lr 1.5e-3 \
    --warmup 20 --conversations 40000 --synthetic 0.9 --plain-share 0.7 --short-copy --code-rows 0.1 --threads 2 \
    --save-every 50
# 6. The same mix at a lower learning rate.
train --init-from "$WORK/stage5" --out "$WORK/stage6" --work "$WORK/w6" --seed 5 --steps 400 --batch 6 --lr 1e-3 \
    --warmup 20 --conversations 40000 --synthetic 0.9 --plain-share 0.7 --short-copy --code-rows 0.1 --threads 2 \
    --save-every 50
# 7. Half of the JSON lookups become whole file lists to copy, as a file-search answer must.
train --init-from "$WORK/stage6" --out "$OUT" --work "$WORK/w7" --seed 7 --steps 400 --batch 6 --lr 1e-3 \
    --warmup 20 --conversations 40000 --synthetic 0.9 --plain-share 0.7 --short-copy --list-share 0.5 --code-rows 0.1 \
    --threads 2 --save-every 50
