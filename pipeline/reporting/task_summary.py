"""What a run computes, in the words `status` and report.html share: the task with how it scores (a score's
method, a variants run's file and score columns), and how many variants a --task variants result holds, by
their status. Read from the manifest, OUT/variants.npz and result.h5 alone."""
from __future__ import annotations

import numpy as np

from ..output.h5io import Reader
from ..output.variant_list import VariantList
from ..output.variants import TABLE
from ..rundir.layout import RunDir


def task_words(run: RunDir, manifest: dict) -> str:
    """`embed`, `score (pll, per residue)`, `score (causal)`, `variants (120 from muts.csv: masked_marginal,
    wt_marginal)`: the task, and for the scoring tasks what the planner resolved (manifest attrs)."""
    config, attrs = manifest["config"], manifest.get("attrs", {})
    task = config["task"]
    if task == "score" and attrs.get("score_method"):
        return f"score ({attrs['score_method']}{', per residue' if config.get('per_residue') else ''})"
    if task == "variants":
        return f"variants ({_variant_count(run)} from {config.get('variants')}: " \
               f"{', '.join(attrs.get('variant_scores', []))})"
    return task


def _variant_count(run: RunDir) -> str:
    try:
        return f"{len(VariantList.load(run.variants_path)):,}"
    except (OSError, ValueError, KeyError) as e:   # a damaged run directory: said, not fatal to status
        return f"? ({run.variants_path} unreadable: {e})"


def variant_statuses(result: Reader) -> dict[int, int]:
    """Status code -> variants of the result's variants table with it; {} for a result without that table."""
    if TABLE not in result.file:
        return {}
    codes, counts = np.unique(result.file[TABLE]["status"][:], return_counts=True)
    return {int(c): int(n) for c, n in zip(codes, counts)}
