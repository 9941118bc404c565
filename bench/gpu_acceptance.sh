#!/usr/bin/env bash
# The first GPU session's one command: everything this project has only run under the Triton interpreter,
# run on the GPU, with one report to read.
#
#   bash bench/gpu_acceptance.sh            # report: bench/out/gpu_acceptance.md, logs beside it
#
# Steps (each timed; its log's tail goes into the report):
#   environment    nvidia-smi, torch / triton / CUDA versions, the visible GPUs
#   numerics       tools/gpu_numerics_probe.py: T5's buckets and the delta rule's extreme gates on the GPU
#   cuda_tests     TRITON_INTERPRET=0 pytest tests/kernels tests/test_engine_triton_path.py: compiled kernels
#                  against their torch and float64 references (T5's relative-position bias too), the compile
#                  matrix, the engine's Triton path against its torch path (ProtT5 and Ankh included); a
#                  GPU-only test that skips counts as a failure here
#   fla_cpu        tests/test_hf_engine_fla.py with fla-core on the path: the hf engine on the CPU keeps
#                  transformers' torch delta rule (fla's kernels would fail on CPU tensors)
#   gated_delta    bench/bench_gated_delta_rule.py beside fla-core's chunk_gated_delta_rule; fla-core (pure
#                  Python) is installed by this script into $OUT/fla_site (--no-deps, with einops; step
#                  fla_install) when $PYTHON cannot import it, so the project's environment is never changed;
#                  FLA_CORE_SPEC overrides what pip installs (e.g. local wheel files on a machine without network)
#   paged_attn     bench/bench_paged_attention.py beside torch SDPA
#   causal_conv    bench/bench_causal_conv.py: the delta-rule layers' conv, Triton beside the torch path and
#                  transformers' conv, at Qwen3.5-0.8B's 6,144 channels
#   engine         bench/bench_engine.py gpu: native beside the hf engine (fla-core on its path when installed
#                  above), Qwen3.5-0.8B and ESM-2-650M shapes
#   t5             bench/bench_t5.py gpu: a ProtT5-XL-shaped encoder (24 layers, bfloat16, T5's relative-position
#                  bias in the attention kernel), native beside transformers' T5EncoderModel
#   pll            bench/bench_pll.py gpu: pseudo-log-likelihood on an ESM-2-650M-shaped masked LM (bfloat16): the
#                  native engine's masked copies (last layer and head at the masks only) beside transformers'
#                  masked copies in padded batches, with the two's largest difference
#   end_to_end     bin/run_shards on 20,000 generated sequences over every visible GPU, then `status`
#
# A rerun of some steps (a lent GPU's minutes are few): STEPS names them, CUDA_TESTS narrows the pytest
# step, STEP_TIMEOUT (seconds) caps each, PLL_ARGS adds arguments to bench_pll.py, e.g.
#   STEPS="environment cuda_tests pll" CUDA_TESTS="tests/kernels/test_position_bias.py" STEP_TIMEOUT=200 \
#       PLL_ARGS="--n 60 --max-len 300" bash bench/gpu_acceptance.sh
#
# It fails loudly: no GPU visible is exit 3 before anything runs; a step that fails (or a GPU test that
# skips) makes the script exit 1 after the others ran, naming the failed steps. PYTHON picks the
# interpreter (default: the checkout's .venv if it has CUDA torch, else python3); OUT the report folder.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
REPORT="$OUT/gpu_acceptance.md"

if [ -z "${PYTHON:-}" ]; then
    PYTHON=python3
    if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
        PYTHON=.venv/bin/python
    fi
fi
if ! command -v nvidia-smi >/dev/null 2>&1 || ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_acceptance: no GPU visible to $PYTHON (nvidia-smi and torch.cuda.is_available() must both work); nothing was run" >&2
    exit 3
fi
missing=$("$PYTHON" -c "
import importlib.util
print(' '.join(m for m in ('torch', 'triton', 'h5py', 'numpy', 'transformers', 'tqdm', 'click') if importlib.util.find_spec(m) is None))")
if [ -n "$missing" ]; then
    echo "gpu_acceptance: $PYTHON lacks $missing: install them (pip install -e . installs all but a CUDA torch)" >&2
    exit 3
fi

STEPS=${STEPS:-environment numerics cuda_tests fla_install fla_cpu gated_delta paged_attn causal_conv engine t5 pll end_to_end}
CUDA_TESTS=${CUDA_TESTS:-tests/kernels tests/test_engine_triton_path.py}
failed=()
{
    echo "# GPU acceptance run, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo
    echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), python $PYTHON"
    echo
} > "$REPORT"

step() {   # step NAME COMMAND...: run it, log it, time it, report it
    local name=$1; shift
    local log="$OUT/gpu_acceptance_$name.log"
    local start end rc
    case " $STEPS " in *" $name "*) ;; *) echo "== $name: not in STEPS, skipped" >&2; return 0 ;; esac
    echo "== $name: $*" >&2
    start=$(date +%s)
    timeout -k 10 "${STEP_TIMEOUT:-3600}" "$@" > "$log" 2>&1
    rc=$?
    [ "$rc" -eq 124 ] && echo "stopped after STEP_TIMEOUT=${STEP_TIMEOUT:-3600} s" >> "$log"
    end=$(date +%s)
    if [ "$rc" -eq 0 ] && { [ "$name" = cuda_tests ] || [ "$name" = fla_cpu ]; } && grep -Eq "[0-9]+ skipped" "$log"; then
        echo "tests were skipped on a GPU machine (fla-core installed): see the skip reasons above" >> "$log"
        rc=1
    fi
    {
        echo "## $name: $([ "$rc" -eq 0 ] && echo ok || echo "FAILED (exit $rc)"), $((end - start)) s"
        echo
        echo '```'
        echo "\$ $*"
        tail -n 60 "$log"
        echo '```'
        echo
    } >> "$REPORT"
    [ "$rc" -eq 0 ] || failed+=("$name")
}

step environment bash -c "nvidia-smi && $PYTHON -c \"
import torch, triton
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(i, p.name, f'sm_{p.major}{p.minor}', p.multi_processor_count, 'SMs', round(p.total_memory / 2**30, 1), 'GiB')
\""
step numerics "$PYTHON" tools/gpu_numerics_probe.py
# shellcheck disable=SC2086 (CUDA_TESTS is a list of paths)
step cuda_tests env TRITON_INTERPRET=0 "$PYTHON" -m pytest -q -rs -p no:cacheprovider --durations=15 $CUDA_TESTS
# fla-core beside the project's environment, never in it: its own folder on PYTHONPATH for the steps that use it.
FLA_SITE="$OUT/fla_site"
FLA_PATH="$FLA_SITE${PYTHONPATH:+:$PYTHONPATH}"
step fla_install bash -c "if PYTHONPATH=$FLA_PATH $PYTHON -c 'import fla' 2>/dev/null; then echo 'fla-core importable'; exit 0; fi
$PYTHON -m pip install --no-deps --target $FLA_SITE ${FLA_CORE_SPEC:-fla-core einops} || {
    echo 'pip could not install fla-core into $FLA_SITE (no network? set FLA_CORE_SPEC to local wheel files of fla-core and einops)'; exit 1; }
PYTHONPATH=$FLA_PATH $PYTHON -c 'import fla; print(\"fla-core\", fla.__version__)'"
step fla_cpu env PYTHONPATH="$FLA_PATH" "$PYTHON" -m pytest -q -rs -p no:cacheprovider tests/test_hf_engine_fla.py
step gated_delta bash -c "PYTHONPATH=$FLA_PATH $PYTHON bench/bench_gated_delta_rule.py --out $OUT/gated_delta_rule.md || exit
if grep -q 'fla-core not importable' $OUT/gated_delta_rule.md; then echo 'no fla-core rows: the comparison did not run'; exit 1; fi"
step paged_attn "$PYTHON" bench/bench_paged_attention.py --out "$OUT/paged_attention.md"
step causal_conv "$PYTHON" bench/bench_causal_conv.py --out "$OUT/causal_conv.md"
step engine env PYTHONPATH="$FLA_PATH" "$PYTHON" bench/bench_engine.py gpu --out "$OUT/engine_gpu.md"
step t5 "$PYTHON" bench/bench_t5.py gpu --out "$OUT/t5_gpu.md"
# shellcheck disable=SC2086 (PLL_ARGS is a list of arguments)
step pll "$PYTHON" bench/bench_pll.py gpu --out "$OUT/pll_gpu.md" ${PLL_ARGS:-}
GPUS=$(nvidia-smi -L | wc -l)
step end_to_end bash -c "set -e
$PYTHON tools/make_fasta.py --n 20000 --seed 5 $OUT/gpu_e2e.fasta
rm -rf $OUT/gpu_e2e_out
time $PYTHON bin/run_shards $OUT/gpu_e2e.fasta --out $OUT/gpu_e2e_out --gpus $GPUS --no-progress
$PYTHON bin/run_shards status $OUT/gpu_e2e_out
grep timings $OUT/gpu_e2e_out/logs/run.log"

if [ ${#failed[@]} -gt 0 ]; then
    echo "gpu_acceptance: FAILED steps: ${failed[*]} (report: $REPORT)" >&2
    echo "**FAILED steps: ${failed[*]}**" >> "$REPORT"
    exit 1
fi
echo "**Every step passed.**" >> "$REPORT"
echo "gpu_acceptance: every step passed (report: $REPORT)" >&2
