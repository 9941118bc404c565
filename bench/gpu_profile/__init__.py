"""The one-shot GPU profile (bench/gpu_profile.sh runs it): one module per step, each a `run(setting, report)`
that prints its tables row by row and keeps its numbers, so that a lent GPU's few minutes give the ESM-2 step's
kernels, the micro-ops beside their ceilings, the host path, the delta rule beside fla-core and the end-to-end
run in one go. `python -m bench.gpu_profile STEP [--smoke]` runs one step; --smoke runs it on CPU at toy sizes.
"""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The checkout (run from anywhere) and bench/, whose scripts' helpers the steps reuse (bench_pll's ESM vocabulary,
# bench_gated_delta_rule's cases, inputs and fla loader).
for _path in (str(REPO), str(REPO / "bench")):
    if _path not in sys.path:
        sys.path.insert(0, _path)
