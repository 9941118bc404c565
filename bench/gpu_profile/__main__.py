"""python -m bench.gpu_profile STEP [--smoke] [--out DIR] [--scratch DIR]: one step of the GPU profile (the
script bench/gpu_profile.sh runs each in its own process, under its own time limit); `summary` prints every
step's status and headline lines, last, for a reader who gets only the end of the output."""
from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
from pathlib import Path

from .report import MARKDOWN, Report, load

# step -> what it measures (its module, bench/gpu_profile/STEP.py, has run(setting, report))
STEPS = {"env": "the card, the software and two measured ceilings",
         "esm_step": "one ~32k-token ESM-2 650M step, native engine and transformers' EsmModel",
         "micro": "the step's GEMMs and elementwise ops, attention beside SDPA",
         "host": "the host's share of a step: tokenizer, prepare, pooling, syncs",
         "gdn": "the gated delta rule per kernel, ours and fla-core's",
         "e2e": "bin/run_shards end to end, native and --engine hf",
         "pll": "bench_pll.py: pseudo-log-likelihood, native beside transformers"}


def summary(out: Path, status: str) -> None:
    states = dict(item.split("=", 1) for item in status.split() if "=" in item)
    data = load(out)
    lines = ["", "## summary", ""]
    for step in STEPS:
        if step not in states and step not in data:
            continue
        lines.append(f"- {step}: {states.get(step, '?')}")
        lines += [f"  - {text}" for text in data.get(step, {}).get("headline", [])]
    text = "\n".join(lines)
    print(text, flush=True)
    with open(out / MARKDOWN, "a") as f:
        f.write(text + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_profile", description=__doc__)
    parser.add_argument("step", choices=[*STEPS, "summary"])
    parser.add_argument("--smoke", action="store_true", help="on CPU at toy sizes: checks the code, not the speed")
    parser.add_argument("--out", type=Path, default=Path("bench/out/gpu_profile"), help="gpu_profile.md and .json here")
    parser.add_argument("--scratch", type=Path, default=None, help="checkpoints and runs (default: a temporary folder)")
    parser.add_argument("--status", default="", help="summary: 'step=state ...' as the script saw them")
    args = parser.parse_args(argv)
    if args.step == "summary":
        summary(args.out, args.status)
        return 0
    from pipeline.models.hf_config import quiet_transformers
    from .setting import Setting
    quiet_transformers()
    title = STEPS[args.step] + (" (SMOKE RUN on CPU at toy sizes: the numbers mean nothing)" if args.smoke else "")
    report = Report(args.out, args.step, title)
    step = importlib.import_module(f".{args.step}", __package__)
    if args.scratch is not None:           # gpu_profile.sh's folder, which the script removes at its end
        step.run(Setting.make(args.smoke, args.scratch), report)
        return 0
    with tempfile.TemporaryDirectory(prefix="gpu_profile_") as scratch:     # a step run by hand leaves nothing
        step.run(Setting.make(args.smoke, Path(scratch)), report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
