"""The host's part of a worker's batch: milliseconds per 32k-token batch, split by part.

    flock /tmp/bench.lock .venv/bin/python bench/bench_host_batch.py [--n 3000] [--budget 32768] [--repeats 3]

What a GPU worker does on the host for each batch, which the overlap (docs/engine.md, "Host and device
overlap") hides behind the device's work: read the records (`SequenceIndex.sequence`, checksums checked),
tokenize (`SequenceTokenizer.encode`: transformers' EsmTokenizer with ESM-2's vocabulary, as an ESM-2 run
does), digest (BLAKE2b per sequence), the rest of `BatchComputer.prepare` (statuses), the engine's step
tensors (scheduler + `ModelRunner.prepare`: block tables, slot mapping, the pinned staging copy), and
taking the results (`BatchComputer.finish`: RowBlock assembly). The device work itself is a tiny ESM (hidden
32, 2 layers) on the CPU, timed as "launch (tiny model)" for reference only.

Input: tools/make_fasta.py lengths (log-normal, median ~260), batches planned as the worker plans them
(length-descending, the token budget, ragged). Each part is timed over all batches, --repeats times; the table
gives the best repeat's mean ms per batch (wall and process CPU time) and us per residue.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from index import SequenceIndex  # noqa: E402
from pipeline.config import RunConfig  # noqa: E402
from pipeline.engine.native import NativeEngine  # noqa: E402
from pipeline.engine.sequence import Sequence  # noqa: E402
from pipeline.output.sequence_digest import digests  # noqa: E402
from pipeline.tasks import make_task, schema_for  # noqa: E402
from pipeline.tasks.tokenization import SequenceTokenizer  # noqa: E402
from pipeline.worker.batch_rows import BatchComputer  # noqa: E402
from pipeline.worker.batching import plan_batches  # noqa: E402

ESM_VOCAB = ["<cls>", "<pad>", "<eos>", "<unk>", "L", "A", "G", "V", "S", "E", "R", "T", "I", "D", "P", "K", "Q",
             "N", "F", "Y", "M", "H", "W", "C", "X", "B", "U", "Z", "O", ".", "-", "<null_1>", "<mask>"]


def write_esm(path: Path) -> Path:
    """A tiny ESM-2-style checkpoint with ESM-2's vocabulary and tokenizer (EsmTokenizer, no fast form)."""
    from transformers import EsmConfig, EsmForMaskedLM, EsmTokenizer
    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.txt").write_text("\n".join(ESM_VOCAB) + "\n")
    torch.manual_seed(0)
    config = EsmConfig(vocab_size=len(ESM_VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=64, max_position_embeddings=1026, position_embedding_type="rotary",
                       pad_token_id=1, mask_token_id=32, token_dropout=True, emb_layer_norm_before=False)
    EsmForMaskedLM(config).eval().save_pretrained(path)
    EsmTokenizer(str(path / "vocab.txt"), model_max_length=1024).save_pretrained(path)
    return path


class Parts:
    def __init__(self):
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}

    def time(self, name: str, fn, *args):
        w, c = time.perf_counter(), time.process_time()
        out = fn(*args)
        self.wall[name] = self.wall.get(name, 0.0) + time.perf_counter() - w
        self.cpu[name] = self.cpu.get(name, 0.0) + time.process_time() - c
        return out


def step_tensors(engine: NativeEngine, toks) -> None:
    """The engine's host work for the batch's steps without the model: schedule, ModelRunner.prepare."""
    scheduler = engine._scheduler()
    for i, t in enumerate(toks):
        scheduler.add(Sequence(i, list(t.ids)))
    while scheduler.has_work():
        step = scheduler.schedule()
        engine.runner.prepare(step, scheduler.blocks)
        scheduler.after_step(step)


def one_pass(index, computer: BatchComputer, engine, batches, positions) -> Parts:
    parts = Parts()
    for a, b in batches:
        todo = positions[a:b]
        texts = parts.time("read", lambda: [index.sequence(int(p)) for p in todo])
        toks = parts.time("tokenize", computer.tokenizer.encode, texts)
        parts.time("digest", digests, texts)
        # prepare = read + tokenize + digest + statuses: its remainder is the statuses
        prepared = parts.time("prepare (all of the above)", computer.prepare, todo)
        parts.time("step tensors", step_tensors, engine, toks)
        launched = parts.time("launch (tiny model)", computer.launch, prepared)
        parts.time("take results (rows)", computer.finish, launched)
    return parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=3000, help="sequences (make_fasta lengths)")
    ap.add_argument("--budget", type=int, default=32768, help="tokens per batch")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        fasta = tmp / "in.fasta"
        subprocess.run([sys.executable, str(REPO / "tools" / "make_fasta.py"), "--n", str(args.n), "--seed", "3",
                        str(fasta)], check=True, capture_output=True)
        model = write_esm(tmp / "esm")
        index = SequenceIndex.build([fasta])
        engine = NativeEngine.load(str(model), torch.device("cpu"), torch.float32, "",
                                   max_tokens_per_step=args.budget)
        config = RunConfig(fasta=[str(fasta)], out=str(tmp / "out"), task="embed", max_tokens_per_batch=args.budget,
                           on_long="truncate")
        task = make_task(config, engine.info)
        tokenizer = SequenceTokenizer(engine.tokenizer, max_tokens=1024)
        task.prepare(tokenizer)
        computer = BatchComputer(index, engine, task, tokenizer, schema_for(task), config, 1024)
        positions = index.order.astype(np.int64)
        tokens = tokenizer.tokens_for_residues(index.lengths[positions])
        batches = plan_batches(np.minimum(tokens, 1024), args.budget, config.max_seqs, padded=False)
        residues = int(index.lengths.sum())
        best = None
        for _ in range(args.repeats):
            parts = one_pass(index, computer, engine, batches, positions)
            if best is None or sum(parts.wall.values()) < sum(best.wall.values()):
                best = parts
    n = len(batches)
    print(f"{args.n} sequences, {residues} residues, {n} batches of <= {args.budget} tokens "
          f"({residues / n:.0f} residues per batch); best of {args.repeats}; torch {torch.__version__}\n")
    print("| part | ms per batch (wall) | ms per batch (CPU) | us per residue |")
    print("| --- | ---: | ---: | ---: |")
    for name in best.wall:
        w, c = best.wall[name] / n * 1e3, best.cpu[name] / n * 1e3
        print(f"| {name} | {w:.1f} | {c:.1f} | {best.wall[name] / residues * 1e6:.2f} |")
    host = ["prepare (all of the above)", "step tensors", "take results (rows)"]
    total = sum(best.wall[k] for k in host) / n * 1e3
    print(f"\nhost part per batch (prepare + step tensors + take results): {total:.1f} ms")


if __name__ == "__main__":
    main()
