#!/usr/bin/env bash
# One command for a lent GPU's few minutes (issue 35 item 7): where the ESM-2 650M step's time goes, at most
# 8 minutes on an H100 so that a rerun fits in 15. Run this first whenever a GPU is available, and record the
# numbers with the card; keep bench/gpu_acceptance.sh for correctness.
#
#   bash bench/gpu_profile.sh                 # every step; report in bench/out/gpu_profile/
#   bash bench/gpu_profile.sh --smoke         # every step on CPU at toy sizes (the tests run this)
#   STEPS="env micro" bash bench/gpu_profile.sh
#
# Steps, in this order, each `python -m bench.gpu_profile STEP` in its own process under its own time limit
# (seconds, defaults summing to 480; STEP_TIMEOUT overrides every one, TOTAL_TIMEOUT the sum), printing its
# tables row by row (a step near its limit leaves out its optional parts, saying so):
#   env (20)       nvidia-smi clocks and power, versions, SMs; measured copy GB/s and 8192^3 bf16 TFLOP/s
#   esm_step (90)  one ~32k-token ESM-2 650M step on the native engine (CUDA events, profiler top-30 kernels,
#                  GPU-busy fraction) and transformers' EsmModel (SDPA, padded batches) on the same sequences
#   micro (50)     cuBLAS at the step's four GEMM shapes; rotary, q scale, LayerNorm, GELU, residual add,
#                  write_kv_cache, paged attention vs SDPA flash (varlen) on the step's tokens; fused kernels
#                  when triton_kernels has them (bench/gpu_profile/micro.py: FUSED)
#   host (40)      tokenizer us/residue, ModelRunner.prepare, EmbedTask.compute, and every host-device sync of
#                  one forward + compute with the project frame that caused it
#   gdn (80)       the delta rule per kernel, ours (both designs: the default "fused" and "split") and fla-core's
#                  Triton path, at bench_gated_delta_rule's shapes, plus one launch-knob variant each of ours
#   e2e (145)      bin/run_shards on 10,000 make_fasta sequences, ESM-2 650M shape, native then --engine hf
#   pll (55)       bench/bench_pll.py gpu with small arguments
# Then a summary of every step's status and headline numbers, last (the end of the output may be all that comes
# back). Files, flat in OUT (default bench/out/gpu_profile): gpu_profile.md (every table), gpu_profile.json
# (the numbers), gpu_profile.log (the whole output). Scratch (checkpoints, FASTA, runs) goes to a temporary
# folder, removed at the end.
#
# Wheels in .whl/ (transformers, tokenizers, fla-core... for a machine without network) are installed into a
# temporary folder put on PYTHONPATH first (not in --smoke, unless WHEELS=1; never with WHEELS=0, for a caller that
# installed them already; at most 60 s, counted in TOTAL_TIMEOUT); the environment is not changed.
# It never changes GPU settings. No GPU visible and no --smoke: exit 3 before anything runs. A step that fails
# or runs out of time does not stop the others; the script then exits 1 naming them.
set -uo pipefail
cd "$(dirname "$0")/.."
SMOKE=""
if [ "${1:-}" = "--smoke" ]; then SMOKE="--smoke"; elif [ -n "${1:-}" ]; then
    echo "usage: bash bench/gpu_profile.sh [--smoke]  (STEPS, STEP_TIMEOUT, TOTAL_TIMEOUT, OUT, PYTHON, WHEELS)" >&2; exit 2
fi
OUT=${OUT:-bench/out/gpu_profile}
export PYTHONUNBUFFERED=1

cuda_python() { "$1" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; }
if [ -z "${PYTHON:-}" ]; then
    PYTHON=python3
    if [ -x .venv/bin/python ] && { [ -n "$SMOKE" ] || cuda_python .venv/bin/python; }; then PYTHON=.venv/bin/python; fi
fi
if [ -z "$SMOKE" ] && { ! command -v nvidia-smi >/dev/null 2>&1 || ! cuda_python "$PYTHON"; }; then
    echo "gpu_profile: no GPU visible to $PYTHON (nvidia-smi and torch.cuda.is_available() must both work);" \
         "nothing was run" \
         "(--smoke runs the steps on CPU)" >&2
    exit 3
fi

began=$(date +%s)   # TOTAL_TIMEOUT counts from here: the wheels' install is part of the 8 minutes
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/gpu_profile.XXXXXX")
trap 'rm -rf "$SCRATCH"' EXIT
if compgen -G ".whl/*.whl" >/dev/null && [ "${WHEELS:-}" != 0 ] && { [ -z "$SMOKE" ] || [ "${WHEELS:-0}" = 1 ]; }; then
    if timeout 60 "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SCRATCH/site" .whl/*.whl; then
        export PYTHONPATH="$SCRATCH/site${PYTHONPATH:+:$PYTHONPATH}"
        echo "gpu_profile: installed $(ls .whl/*.whl | wc -l) wheels from .whl/ into a temporary site (on PYTHONPATH)"
    else
        echo "gpu_profile: the wheels in .whl/ did not install; going on with the environment as it is" >&2
    fi
fi

mkdir -p "$OUT"
rm -f "$OUT/gpu_profile.md" "$OUT/gpu_profile.json" "$OUT/gpu_profile.log"
LOG="$OUT/gpu_profile.log"
STEPS=${STEPS:-env esm_step micro host gdn e2e pll}
# The limits spend a GPU lease (480 s in all); on a CPU (--smoke) they only guard against a hang, and a busy
# machine (a test suite's other workers beside it) must not stop a step there: three times as long.
SCALE=1; [ -n "$SMOKE" ] && SCALE=3
TOTAL=${TOTAL_TIMEOUT:-$((480 * SCALE))}
declare -A LIMIT=([env]=20 [esm_step]=90 [micro]=50 [host]=40 [gdn]=80 [e2e]=145 [pll]=55)
{
    echo "# GPU profile, $(date -u +%Y-%m-%dT%H:%M:%SZ)${SMOKE:+ (SMOKE: CPU, toy sizes)}"
    echo
    echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), python $PYTHON, steps: $STEPS"
} > "$OUT/gpu_profile.md"

status=()
failed=()
for name in $STEPS; do
    if [ -z "${LIMIT[$name]+x}" ]; then
        echo "gpu_profile: unknown step '$name' (steps: ${!LIMIT[*]})" | tee -a "$LOG" >&2
        status+=("$name=unknown"); failed+=("$name"); continue
    fi
    left=$((TOTAL - ($(date +%s) - began)))
    limit=${STEP_TIMEOUT:-$((LIMIT[$name] * SCALE))}
    [ "$limit" -gt "$left" ] && limit=$left
    if [ "$limit" -lt 5 ]; then
        echo "== $name: skipped, ${left} s left of TOTAL_TIMEOUT=$TOTAL" | tee -a "$LOG"
        status+=("$name=skipped(no-time-left)"); failed+=("$name"); continue
    fi
    echo "== $name (limit $limit s)" | tee -a "$LOG"
    start=$(date +%s)
    # A step may leave out its optional parts when it sees its end coming (setting.py: seconds_left).
    export GPU_PROFILE_DEADLINE=$(($(date +%s) + limit))
    timeout -k 5 "$limit" "$PYTHON" -m bench.gpu_profile "$name" $SMOKE --out "$OUT" --scratch "$SCRATCH" 2>&1 \
        | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    took=$(($(date +%s) - start))
    if [ "$rc" -eq 0 ]; then
        status+=("$name=ok(${took}s)")
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        echo "== $name: stopped at its limit of $limit s (rows above are what it finished)" | tee -a "$LOG"
        echo "**stopped at its limit of $limit s**" >> "$OUT/gpu_profile.md"
        status+=("$name=timeout(${limit}s)"); failed+=("$name")
    else
        echo "== $name: FAILED (exit $rc)" | tee -a "$LOG"
        echo "**FAILED (exit $rc): see gpu_profile.log**" >> "$OUT/gpu_profile.md"
        status+=("$name=failed(exit-$rc)"); failed+=("$name")
    fi
done
"$PYTHON" -m bench.gpu_profile summary --out "$OUT" --status "${status[*]}" 2>&1 | tee -a "$LOG"
echo "gpu_profile: $(($(date +%s) - began)) s in all; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
if [ ${#failed[@]} -gt 0 ]; then
    echo "gpu_profile: steps that did not finish: ${failed[*]}" >&2
    exit 1
fi
