"""Pseudo-log-likelihood: the native engine (run_shards' score task) against the straightforward transformers
recipe, on the same sequences, in one run.

    python bench/bench_pll.py cpu                        # ESM-2 8M shape, 40 sequences of up to 200 residues
    python bench/bench_pll.py cpu --n 100 --max-len 300 --model esm2-35m
    python bench/bench_pll.py cpu --clock cpu            # CPU time instead of wall time (a shared machine)
    python bench/bench_pll.py gpu                        # ESM-2 650M shape, bfloat16, 200 sequences of up to 500
    python bench/bench_pll.py cpu --breakdown            # + where each engine's CPU time goes (torch profiler)

Both compute, for every sequence, the L masked copies (each residue masked in turn) and sum log p(residue)
at each copy's mask, log-softmax in float64:

- native: `--task score` as a worker runs it (tasks/masked_score.py): batches planned on the copies' tokens
  (pipeline.worker.batching), the copies as ragged batches without padding on the native engine, the first
  layer's projections once per row the copies share, the last layer and the masked-LM head only at each copy's
  masked position (Engine.logprobs_at).
- transformers: EsmForMaskedLM on the copies of consecutive sequences (longest first) in padded batches of at
  most the same token budget (copies x longest copy), logits at every position, log_softmax at the masks.

Sequences come from tools/make_fasta.py (seed 1), cut to --max-len residues, longest first. The two take
turns on slices of the sequences so a shared machine's changing load hits both alike; a warm-up is not
timed. Weights are random (throughput does not depend on them). Prints a markdown table (tokens are the
tokens each computed: padding included for transformers), and the largest difference between the two's sums.

--breakdown (CPU, best with 1 thread) then runs each engine once more over every sequence under torch.profiler
and adds a table of where that time went (each op's own time): matrix products (addmm, mm, bmm: the linear
layers, the same GEMMs in both), attention (SDPA's CPU kernel, which both call) and the rest (norms, GELU,
rotary, copies). The profiler adds its own cost to every op, most to small ones (so "the rest" reads high);
products and attention are large ops it barely touches. They are the part no reorganisation removes, so
transformers' timed seconds over native's products + attention bound the speedup any engine that runs these
products and this attention kernel could reach.
"""
from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.scratch import scratch_folder  # noqa: E402
from pipeline.config import RunConfig  # noqa: E402
from pipeline.worker.batching import plan_batches  # noqa: E402

# The ESM alphabet (the published vocab.txt of ESM-2 / ESM-1b / ESM-1v) and ESM-2's published shapes.
ESM_VOCAB = ["<cls>", "<pad>", "<eos>", "<unk>", "L", "A", "G", "V", "S", "E", "R", "T", "I", "D", "P", "K", "Q",
             "N", "F", "Y", "M", "H", "W", "C", "X", "B", "U", "Z", "O", ".", "-", "<null_1>", "<mask>"]
ESM2_COMMON = dict(vocab_size=33, max_position_embeddings=1026, position_embedding_type="rotary", token_dropout=True,
                   emb_layer_norm_before=False, pad_token_id=1, mask_token_id=32)
SHAPES = {"esm2-8m": dict(hidden_size=320, intermediate_size=1280, num_hidden_layers=6, num_attention_heads=20),
          "esm2-35m": dict(hidden_size=480, intermediate_size=1920, num_hidden_layers=12, num_attention_heads=20),
          "esm2-650m": dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=33, num_attention_heads=20)}


def write_checkpoint(name: str, path: Path) -> Path:
    from transformers import EsmConfig, EsmForMaskedLM, EsmTokenizer
    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.txt").write_text("\n".join(ESM_VOCAB) + "\n")
    EsmTokenizer(str(path / "vocab.txt"), model_max_length=1024).save_pretrained(path)
    torch.manual_seed(0)
    EsmForMaskedLM(EsmConfig(**SHAPES[name], **ESM2_COMMON)).save_pretrained(path)
    return path


def sequences(n: int, max_len: int) -> list[str]:
    with tempfile.TemporaryDirectory(prefix="bench_pll_fasta_") as folder:
        fasta = Path(folder) / "bench.fasta"
        subprocess.run([sys.executable, str(REPO / "tools" / "make_fasta.py"), "--n", str(n), "--seed", "1",
                        str(fasta)], check=True, capture_output=True)
        texts = ["".join(r.split("\n")[1:])[:max_len] for r in fasta.read_text().split(">")[1:]]
    return sorted(texts, key=len, reverse=True)


class Native:
    """The score task on the native engine, batched as a worker batches it."""

    def __init__(self, path: Path, device, dtype, budget: int):
        from pipeline.engine.native import NativeEngine
        from pipeline.tasks import make_task
        from pipeline.tasks.tokenization import SequenceTokenizer
        self.engine = NativeEngine.load(str(path), device, dtype, "", max_tokens_per_step=budget)
        self.task = make_task(RunConfig(fasta=["x"], task="score"), self.engine.info)
        self.tokenizer, self.budget = SequenceTokenizer(self.engine.tokenizer), budget
        self.task.prepare(self.tokenizer)
        self.tokens = 0

    def __call__(self, texts: list[str]) -> np.ndarray:
        toks = self.tokenizer.encode(texts)
        lengths = np.array([len(t.ids) for t in toks])
        sums = []
        for a, b in plan_batches(self.task.batch_tokens(lengths, np.arange(len(toks))), self.budget, 256, padded=False):
            out = self.task.run(self.engine, toks[a:b], np.arange(a, b))
            sums.append(out.columns["score/logprob_sum"])
            self.tokens += out.computed_tokens
        return np.concatenate(sums)


class Transformers:
    """EsmForMaskedLM on the masked copies in padded batches under the token budget."""

    def __init__(self, path: Path, device, dtype, budget: int):
        from transformers import AutoTokenizer, EsmForMaskedLM
        self.model = EsmForMaskedLM.from_pretrained(path, dtype=dtype).to(device).eval()
        self.tokenizer, self.device, self.budget = AutoTokenizer.from_pretrained(path), device, budget
        self.tokens = 0

    @torch.inference_mode()
    def __call__(self, texts: list[str]) -> np.ndarray:
        mask, pad = self.tokenizer.mask_token_id, self.tokenizer.pad_token_id
        copies = []   # (sequence, masked position, ids)
        for s, ids in enumerate(self.tokenizer(texts)["input_ids"]):
            copies += [(s, p, ids[:p] + [mask] + ids[p + 1:], ids[p]) for p in range(1, len(ids) - 1)]
        sums = np.zeros(len(texts))
        start = 0
        while start < len(copies):
            k = max(1, self.budget // len(copies[start][2]))
            batch = copies[start:start + k]
            start += k
            width = max(len(c[2]) for c in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.int64)
            for i, c in enumerate(batch):
                ids[i, :len(c[2])] = torch.tensor(c[2])
            attention = (ids != pad).long()
            logits = self.model(input_ids=ids.to(self.device), attention_mask=attention.to(self.device)).logits
            rows = torch.arange(len(batch), device=self.device)
            lp = torch.log_softmax(logits[rows, [c[1] for c in batch]].double(), dim=-1)
            own = lp[rows, [c[3] for c in batch]].cpu().numpy()
            np.add.at(sums, [c[0] for c in batch], own)
            self.tokens += ids.numel()
        return sums


class Breakdown:
    """Profiled CPU seconds of one engine, summed over its turns, by kind of op."""
    PRODUCTS = ("aten::addmm", "aten::mm", "aten::bmm", "aten::baddbmm", "aten::matmul")
    ATTENTION = ("aten::_scaled_dot_product_flash_attention_for_cpu",)

    def __init__(self):
        self.products = self.attention = self.total = 0.0

    @property
    def rest(self) -> float:
        return self.total - self.products - self.attention

    @contextlib.contextmanager
    def profiling(self):
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            yield
        for event in prof.key_averages():
            seconds = event.self_cpu_time_total / 1e6
            self.total += seconds
            if event.key in self.PRODUCTS:
                self.products += seconds
            elif event.key in self.ATTENTION:
                self.attention += seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("device", choices=["cpu", "gpu"])
    parser.add_argument("--model", choices=sorted(SHAPES), default=None, help="default: esm2-8m (CPU), esm2-650m (GPU)")
    parser.add_argument("--n", type=int, default=None, help="sequences (default 40 on CPU, 200 on GPU)")
    parser.add_argument("--max-len", type=int, default=None, help="residues kept per sequence (200 CPU, 500 GPU)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-tokens-per-batch", type=int, default=None, help="default: the pipeline's (4096 CPU, 32768 GPU)")
    parser.add_argument("--slices", type=int, default=8, help="turns each engine takes")
    parser.add_argument("--out", default=None, help="also write the table here")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: time this process's CPU time (steadier than wall time on a shared machine; CPU only)")
    parser.add_argument("--breakdown", action="store_true",
                        help="CPU: also show where each engine's time goes (products, attention, the rest)")
    args = parser.parse_args()
    gpu = args.device == "gpu"
    if gpu and not torch.cuda.is_available():
        raise SystemExit("gpu benchmark: no CUDA device visible")
    device = torch.device("cuda:0" if gpu else "cpu")
    dtype = torch.bfloat16 if gpu else torch.float32
    name = args.model or ("esm2-650m" if gpu else "esm2-8m")
    n, max_len = args.n or (200 if gpu else 40), args.max_len or (500 if gpu else 200)
    budget = args.max_tokens_per_batch or (32768 if gpu else 4096)
    from pipeline.models.hf_config import quiet_transformers
    from pipeline.worker.cpu_setup import keep_freed_memory, set_cpu_threads
    set_cpu_threads(args.threads)
    if not gpu:
        keep_freed_memory()
    quiet_transformers()
    path = write_checkpoint(name, scratch_folder(f"bench_pll_{name}_") / name)
    texts = sequences(n, max_len)
    engines = {"transformers": Transformers(path, device, dtype, budget), "native": Native(path, device, dtype, budget)}
    for engine in engines.values():   # warm-up, not timed
        engine(texts[-2:])
        engine.tokens = 0
    seconds, sums = {k: 0.0 for k in engines}, {k: [] for k in engines}
    bounds = np.linspace(0, len(texts), min(args.slices, len(texts)) + 1).astype(int)
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    if args.clock == "cpu" and gpu:
        raise SystemExit("--clock cpu times CPU runs only: a GPU's work is not this process's CPU time")
    if args.breakdown and gpu:
        raise SystemExit("--breakdown profiles CPU runs only")
    parts = {k: Breakdown() for k in engines}
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        for kind in (list(engines) if i % 2 == 0 else list(engines)[::-1]):
            sync()
            t = clock()
            sums[kind].append(engines[kind](texts[a:b]))
            sync()
            seconds[kind] += clock() - t
    if args.breakdown:   # an extra, profiled pass of each engine over every sequence, after the timed ones
        for kind, engine in engines.items():
            timed_tokens = engine.tokens
            with parts[kind].profiling():
                engine(texts)
            engine.tokens = timed_tokens
    residues = sum(len(t) for t in texts)
    masked = sum(len(t) * (len(t) + 2) for t in texts)
    lines = [f"{name} shape, {str(dtype).removeprefix('torch.')}, "
             f"{'GPU ' + torch.cuda.get_device_name(0) if gpu else f'CPU, {args.threads} thread(s)'}; {n} make_fasta.py "
             f"sequences (seed 1) cut at {max_len} residues ({residues} residues, {masked} tokens in their masked "
             f"copies); token budget {budget}; torch {torch.__version__}"
             + ("; seconds are CPU time" if args.clock == "cpu" else ""), "",
             "| engine | tokens computed | seconds | residues/s | masked-copy tokens/s | vs transformers |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for kind in engines:
        lines.append(f"| {kind} | {engines[kind].tokens:,} | {seconds[kind]:.1f} | {residues / seconds[kind]:,.0f} | "
                     f"{masked / seconds[kind]:,.0f} | {seconds['transformers'] / seconds[kind]:.2f}x |")
    diff = np.abs(np.concatenate(sums["native"]) - np.concatenate(sums["transformers"])).max()
    scale = np.abs(np.concatenate(sums["transformers"])).max()
    lines += ["", f"largest difference between the two's sums: {diff:.3g} (of sums up to {scale:.4g})"]
    if args.breakdown:
        lines += ["", "Where the time went, in an extra profiled pass over the same sequences (each op's own seconds, "
                      "torch profiler):", "",
                  "| engine | matrix products | attention (SDPA) | the rest | total |", "| --- | ---: | ---: | ---: | ---: |"]
        for kind, b in parts.items():
            lines.append(f"| {kind} | {b.products:.1f} | {b.attention:.1f} | {b.rest:.1f} | {b.total:.1f} |")
        floor = parts["native"].products + parts["native"].attention
        lines += ["", f"transformers' timed seconds over native's products + attention: {seconds['transformers'] / floor:.2f}x "
                      "(the most an engine running these products and this attention kernel could gain: everything else "
                      "free)"]
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
