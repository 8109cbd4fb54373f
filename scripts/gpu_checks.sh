#!/usr/bin/env bash
# Every GPU check and GPU benchmark in one run, for a session that is lent a CUDA machine (about 15 minutes of
# device time in all): the tests marked `gpu`, then `bench offline --device cuda` against transformers, with the
# decode roofline share. The device machine has torch, transformers, safetensors, tokenizers and tiktoken but no
# network, so the package runs from the checkout (PYTHONPATH), not installed. Logs and JSON go to ${OUT:-gpu-results}/.
# Usage (from the repository root): bash scripts/gpu_checks.sh
# fla-core (KDA prefill's `fla` backend) is not on the device machine and it has no network: carry it as wheels.
# Here, once: echo /.whl/ >> .git/info/exclude; python3 -m pip download --no-deps --only-binary=:all: -d .whl \
#   fla-core==0.6.0 einops==0.8.2   (both pure Python); then `run` with carry [".whl"]: this script installs them.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}
mkdir -p "$out"
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
{ nvidia-smi; $py -c "import torch, transformers; print(torch.__version__, transformers.__version__,
  torch.cuda.get_device_name(0))"; } > "$out/env.txt" 2>&1
$py -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_gpu.py tests/runner/test_host_cache.py \
  tests/ops/test_mla_triton.py tests/ops/test_kda_triton.py tests/ops/test_moe_triton.py \
  tests/ops/test_mla_expanded_sdpa.py tests/ops/test_kda_fla.py > "$out/pytest-gpu.txt" 2>&1
tail -3 "$out/pytest-gpu.txt"
bench() {  # name, then bench offline arguments; without the transformers baseline if that one fails
  $py -m deltaserve.entrypoints.cli bench offline --device cuda --result-file "$out/$1.json" "${@:2}" \
    > "$out/$1.txt" 2>&1 \
  || $py -m deltaserve.entrypoints.cli bench offline --device cuda --no-baseline --result-file "$out/$1.json" \
    "${@:2}" >> "$out/$1.txt" 2>&1
  grep -E "deltaserve:|transformers:|speedup|roofline" "$out/$1.txt"
}
bench offline-32x256x128 --num-prompts 32 --input-len 256 --output-len 128
bench offline-64x1024x256 --num-prompts 64 --input-len 1024 --output-len 256
bench offline-bf16-32x256x128 --dtype bfloat16 --num-prompts 32 --input-len 256 --output-len 128
# CUDA graphs (issue 21): the same decode-heavy runs without them (--enforce-eager), batch 1 and 8 too.
bench offline-bf16-32x256x128-eager --dtype bfloat16 --num-prompts 32 --input-len 256 --output-len 128 --enforce-eager
bench offline-bf16-1x256x256 --dtype bfloat16 --num-prompts 1 --input-len 256 --output-len 256 --no-baseline
bench offline-bf16-1x256x256-eager --dtype bfloat16 --num-prompts 1 --input-len 256 --output-len 256 --no-baseline \
  --enforce-eager
bench offline-bf16-8x256x256 --dtype bfloat16 --num-prompts 8 --input-len 256 --output-len 256 --no-baseline
bench offline-bf16-8x256x256-eager --dtype bfloat16 --num-prompts 8 --input-len 256 --output-len 256 --no-baseline \
  --enforce-eager
# Kimi-Linear-48B layer shapes on 2 layers (layer 1: KDA, 32 heads of 128, with the dense 9216 FFN; layer 2: MLA,
# 32 heads, rank 512, with 64 of the 256 experts, top-8, and the shared expert; vocabulary 163840), bf16, batch 1, 8
# and 32 against transformers (with fla), and a 2K prefill: per-layer figures, scaled to 27 layers in the report.
mk() { $py -m deltaserve.entrypoints.cli make-tiny "$@" > /dev/null 2>&1 || echo "make-tiny failed: $*"; }
mk /tmp/k48x2 --hidden 2304 --layers 2 --vocab 163840 --intermediate 9216 --moe-intermediate 1024 --experts 64 \
  --top-k 8 --shared-experts 1 --num-expert-group 1 --topk-group 1 --kda-heads 32 --kda-head-dim 128 --mla-heads 32 \
  --kv-lora-rank 512 --qk-nope-head-dim 128 --qk-rope-head-dim 64 --v-head-dim 128 --first-k-dense 1
for b in 1 8 32; do
  bench k48x2-bf16-b$b --model /tmp/k48x2 --dtype bfloat16 --num-prompts $b --input-len 256 --output-len 128
done
bench k48x2-bf16-prefill2k --model /tmp/k48x2 --dtype bfloat16 --num-prompts 1 --input-len 2048 --output-len 2
# A Kimi K3 shape with MXFP4 experts (hidden 7168, 96 KDA / MLA heads, q-LoRA 1536, LatentMoE 3584 with 32 of the
# 896 experts of width 3072, top-16, 2 shared, SiTU, Block AttnRes) on 2 layers, vocabulary cut to 32768.
mk /tmp/k3x2 --arch kimi_k3 --hidden 7168 --layers 2 --vocab 32768 --intermediate 33792 --moe-intermediate 3072 \
  --latent-size 3584 --experts 32 --top-k 16 --shared-experts 2 --num-expert-group 1 --topk-group 1 --kda-heads 96 \
  --kda-head-dim 128 --mla-heads 96 --q-lora-rank 1536 --kv-lora-rank 512 --qk-nope-head-dim 128 \
  --qk-rope-head-dim 64 --v-head-dim 128 --first-k-dense 1 --attn-res-block-size 2 --routed-scaling-factor 1.0
for b in 1 32; do
  bench k3x2-bf16-b$b --model /tmp/k3x2 --dtype bfloat16 --num-prompts $b --input-len 256 --output-len 64 --no-baseline
done
# The host tier's copies on a copy stream beside the forward vs all before it (issue 20), rehydrating an evicted 4K
# session on the tiny checkpoint.
$py -m deltaserve.entrypoints.cli bench followup --device cuda --evict-tokens 8000 --num-blocks 400 \
  --host-cache-memory 512MiB --shared 0.97 --compare-copy-overlap --result-file "$out/followup-overlap.json" \
  > "$out/followup-overlap.txt" 2>&1
tail -8 "$out/followup-overlap.txt"
