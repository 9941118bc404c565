"""The native engine's KV cache for a model shape, sized for the model's length limit (as before 2026-12-06)
and for a run's longest record (what a worker sizes it for now: the manifest's `longest_prompt`):

    python bench/kv_cache_size.py qwen35-0.8b --limit 262144 --longest 1026

The shape's real model class is built on the meta device (bench/step_ledger.py's shapes: published config
values), and the pages come from the engine's own sizing (`EngineConfig._derived_pages`) with --max-seqs 256
and the default budget of each device: 4,096 tokens on CPU in float32, 32,768 on a GPU in bfloat16 (the
Triton kernels' cache layout). Nothing is allocated; no GPU is needed.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from pipeline.config import DEFAULT_TOKENS_CPU, DEFAULT_TOKENS_GPU  # noqa: E402
from pipeline.engine.config import PAGE_SIZE, EngineConfig  # noqa: E402
from step_ledger import build_on_meta, shapes  # noqa: E402

DEVICES = (("CPU", torch.float32, False, DEFAULT_TOKENS_CPU), ("GPU", torch.bfloat16, True, DEFAULT_TOKENS_GPU))


def sizes(shape: str, limit: int, longest: int, max_seqs: int = 256) -> list[dict]:
    spec = build_on_meta(shapes()[shape]).spec
    rows = []
    for device, dtype, triton, budget in DEVICES:
        for held, what in ((limit, "the model's limit"), (longest, "the longest record")):
            pages = EngineConfig(max_tokens_per_step=budget, max_seqs=max_seqs, max_model_len=held)._derived_pages(spec)
            rows.append(dict(device=device, dtype=str(dtype).removeprefix("torch."), budget=budget, held=held,
                             what=what, pages=pages, bytes=pages * PAGE_SIZE * spec.kv_bytes_per_token(dtype, triton)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", help="a bench/step_ledger.py shape: esm2-650m, esm2-3b, prott5-xl, ankh-large, "
                                      "qwen35-0.8b")
    parser.add_argument("--limit", type=int, required=True, help="the model's length limit in tokens")
    parser.add_argument("--longest", type=int, required=True, help="the run's longest record in tokens")
    args = parser.parse_args()
    print("| device | budget | sized for | pages | KV cache |\n| --- | ---: | --- | ---: | ---: |")
    for r in sizes(args.shape, args.limit, args.longest):
        print(f"| {r['device']} ({r['dtype']}) | {r['budget']:,} | {r['what']} ({r['held']:,} tokens) | "
              f"{r['pages']:,} | {r['bytes'] / 1e9:.2f} GB |")


if __name__ == "__main__":
    main()
