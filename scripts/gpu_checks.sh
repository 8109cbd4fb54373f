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
# The host tier's copies on a copy stream beside the forward vs all before it (issue 20), rehydrating an evicted 4K
# session on the tiny checkpoint.
$py -m deltaserve.entrypoints.cli bench followup --device cuda --evict-tokens 8000 --num-blocks 400 \
  --host-cache-memory 512MiB --shared 0.97 --compare-copy-overlap --result-file "$out/followup-overlap.json" \
  > "$out/followup-overlap.txt" 2>&1
tail -8 "$out/followup-overlap.txt"
