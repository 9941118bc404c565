#!/usr/bin/env bash
# Before a lent GPU machine's call, here (with network): the wheels it needs beyond its image, into .whl/, which
# bench/gpu_profile.sh installs into a temporary site on PYTHONPATH there (the call carries .whl).
#
#   bash bench/gpu_wheels.sh                  # transformers 5.24.0 and fla-core 0.6.0 for the image's Python 3.12
#   TRANSFORMERS=5.25.0 bash bench/gpu_wheels.sh
#
# The image (the device tool's KINDS.md, read 2026-11-17) has torch 2.11, triton 3.6, h5py, click, tqdm, numpy,
# tokenizers 0.23.2, safetensors 0.8.0, huggingface-hub 1.33.0, einops, sentencepiece and transformers 5.17.0. This
# checkout's tests run transformers 5.25, which asks for huggingface-hub >= 2.4 (and that for httpx2, not in the
# image); 5.24.0 asks for >= 1.31, which the image meets, so it is the default. On 2026-12-05 the family, tokenizer,
# engine, generate and scoring tests and `gpu_profile.sh --smoke` passed on the CPU with the image's versions and
# 5.24.0 (docs/BENCHMARKS.md). fla-core (pure Python + Triton) is what issue 36 compares the delta rule with; the
# hf engine takes Qwen3.5's delta rule from it on a GPU. One version of each package only: two stop the install.
set -euo pipefail
cd "$(dirname "$0")/.."
TRANSFORMERS=${TRANSFORMERS:-5.24.0}
FLA_CORE=${FLA_CORE:-0.6.0}
PY=${PYTHON:-python3}

mkdir -p .whl
rm -f .whl/*.whl
EXCLUDE=$(git rev-parse --git-path info/exclude)   # (.git is a file in a worktree)
mkdir -p "$(dirname "$EXCLUDE")"
grep -qx '/.whl/' "$EXCLUDE" 2>/dev/null || echo '/.whl/' >> "$EXCLUDE"
# PIP_CONFIG_FILE=/dev/null: past a local wheel cache or index that holds other versions than PyPI's
PIP_CONFIG_FILE=/dev/null "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "transformers==$TRANSFORMERS" "fla-core==$FLA_CORE"
ls -l .whl
echo "gpu_wheels: $(du -ch .whl/*.whl | tail -1 | cut -f1) in .whl/ (a call carries at most 64 MiB): name .whl in the" \
     "call's carry; bash bench/gpu_profile.sh installs them there by itself (WHEELS=0 skips them)"
