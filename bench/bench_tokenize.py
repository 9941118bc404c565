#!/usr/bin/env python3
"""Tokenization on the worker's path: the tokenizer itself beside the table lookup (pipeline/tasks/
residue_lookup.py), in microseconds per residue.

    python bench/bench_tokenize.py [--repeats 5] [--families demo,esm2_t33_650m,...] [--out bench/out/tokenize.md]

`SequenceTokenizer.encode` (what BatchComputer.rows calls for every batch) on make_fasta sequences, two ways:
`lookup=False` (every sequence through transformers' tokenizer, as before) and the default (the lookup where
the tokenizer gives each residue a token of its own). Two cases: one batch of the engine's 32,768-token budget
(the sequences make_fasta writes first, until 32k residues) and 300 sequences. Tokenizers are built offline:
the demo model's and tiny family checkpoints with the published tokenizer files (tests/families/). Each time
is the best of --repeats, wall clock and process CPU; the ids of both ways are checked identical first.
"""
from __future__ import annotations

import argparse
import io
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

BUDGET = 32768
FAMILIES = ["demo", "esm2_t33_650m", "saprot", "prot_t5_xl_u50", "prot_bert"]


def make_sequences(n: int, seed: int = 1) -> list[str]:
    """n make_fasta sequences (its length distribution and residue frequencies)."""
    import make_fasta
    buf = io.BytesIO()
    make_fasta.write(buf, n, seed, 30, 5000, 60, None)
    records = buf.getvalue().decode().split(">")[1:]
    return ["".join(r.splitlines()[1:]) for r in records]


def tokenizer_of(name: str, root: Path):
    """(tokenizer, convention) as the worker gets them."""
    from pipeline.models import checkpoint, demo
    from pipeline.models.conventions import PLAIN
    if name == "demo":
        return demo.build_tokenizer(), PLAIN
    from tests.families import checkpoints
    source = checkpoint.local_source(str(checkpoints.build_cached(name, root)))
    return checkpoint.read_tokenizer(source, checkpoint.read_config(source)), source.family.convention


def best(fn, repeats: int) -> tuple[float, float]:
    """Best wall and best process-CPU seconds of `repeats` calls."""
    walls, cpus = [], []
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return min(walls), min(cpus)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--out", default=str(REPO / "bench" / "out" / "tokenize.md"))
    args = ap.parse_args()
    from pipeline.models.hf_config import quiet_transformers
    from pipeline.tasks.tokenization import SequenceTokenizer
    quiet_transformers()

    pool = make_sequences(2000)
    cumulative, batch = 0, []
    for s in pool:
        if cumulative + len(s) > BUDGET:
            break
        batch.append(s)
        cumulative += len(s)
    cases = {f"one 32k batch ({len(batch)} seqs)": batch, "300 sequences": pool[:300]}

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    lines = [f"Machine: {os.cpu_count()} cores, {cpu}, load average {os.getloadavg()[0]:.1f}; "
             f"{time.strftime('%Y-%m-%d')}. Best of {args.repeats}; us per residue, wall (process CPU).", "",
             "| tokenizer | case | residues | tokenizer us/res | lookup us/res | speed-up (wall) |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    print("\n".join(lines), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.families.split(","):
            hf, convention = tokenizer_of(name, Path(tmp))
            old = SequenceTokenizer(hf, convention, lookup=False)
            new = SequenceTokenizer(hf, convention)
            label = f"{name} ({type(hf).__name__}{', lookup' if new.looks_up else ', no lookup'})"
            for case, seqs in cases.items():
                a, b = old.encode(seqs), new.encode(seqs)
                assert [t.ids for t in a] == [t.ids for t in b], f"{name}: the lookup's ids differ"
                residues = sum(map(len, seqs))
                (ow, oc), (nw, nc) = best(lambda: old.encode(seqs), args.repeats), best(lambda: new.encode(seqs), args.repeats)
                us = 1e6 / residues
                lines.append(f"| {label} | {case} | {residues:,} | {ow * us:.3f} ({oc * us:.3f}) | "
                             f"{nw * us:.3f} ({nc * us:.3f}) | {ow / nw:.1f}x |")
                print(lines[-1], flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
