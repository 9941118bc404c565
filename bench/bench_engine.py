"""Native engine vs hf engine: embed throughput (tokens/s) on the same sequences, in one run.

    python bench/bench_engine.py cpu                     # demo model + Qwen3.5 at ~1/8 of 0.8B, 20k sequences
    python bench/bench_engine.py cpu --n 2000 --models qwen35-eighth --threads 2
    python bench/bench_engine.py gpu                     # Qwen3.5-0.8B-shaped and ESM-2-650M-shaped, bf16, 50k
                                                         # sequences, plus one 32k-token sequence (native)

`--engines hf,native,native-variant` also times the native engine without batch invariance
(--no-batch-invariant), the engines taking turns as below. On CPU the process first puts MKL in strict
CNR mode as a worker of a batch-invariant run does, for every engine (`--mkl-default` leaves it in its
default mode, as a --no-batch-invariant or hf worker runs; bench/mkl_strict_cost.py compares the two,
which cannot share a process).

Sequences come from tools/make_fasta.py (UniRef-like lengths, seed 1). Each engine runs them the way a
worker does: length-descending order, batches planned by pipeline.worker.batching.plan_batches under the same
token budget (padded batches for hf, ragged for native), the embed task (mean of the final hidden
state) applied to every batch. The engines take turns on (up to 40) consecutive slices of the sorted sequences,
so a shared machine's changing load affects both alike. Model loading and a warm-up batch are not
timed. Weights are random (throughput does not depend on their values). Prints a markdown table; --out
also writes it to a file.
"""
from __future__ import annotations

import argparse
import gc
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline.models import demo as demo_model  # noqa: E402
from pipeline.worker.batching import plan_batches  # noqa: E402

# Qwen3.5-0.8B's text model (hidden 1024, 24 layers, every 4th gated attention with 8 query / 2 KV heads
# of 256, 16 delta-rule heads of 128) and a version at about 1/8 of its non-embedding parameters.
QWEN35_08B = dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
                  linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=248320, tie_word_embeddings=True)
QWEN35_EIGHTH = dict(hidden_size=512, intermediate_size=1792, num_hidden_layers=12, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=128, linear_num_key_heads=8, linear_num_value_heads=8,
                     linear_key_head_dim=64, linear_value_head_dim=64, vocab_size=32, tie_word_embeddings=True)
ESM2_COMMON = dict(vocab_size=33, max_position_embeddings=1026, position_embedding_type="rotary", token_dropout=True,
                   emb_layer_norm_before=False, pad_token_id=0, mask_token_id=32)
ESM2_650M = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=33, num_attention_heads=20, **ESM2_COMMON)
# What embed() times with: wall time, or with --clock cpu this process's CPU time (on a shared machine with
# 1 thread, what other processes' load does not stretch).
CLOCK = [time.perf_counter]
ESM2_8M = dict(hidden_size=320, intermediate_size=1280, num_hidden_layers=6, num_attention_heads=20, **ESM2_COMMON)


def write_checkpoint(name: str, path: Path, dtype: torch.dtype, device: torch.device) -> Path:
    """A checkpoint directory for `name` (random weights), with the demo's protein tokenizer."""
    if name == "demo":
        return demo_model.write(path)
    from transformers import EsmConfig, EsmModel, Qwen3_5ForCausalLM, Qwen3_5TextConfig
    torch.manual_seed(0)
    with torch.device(device):
        if name.startswith("qwen35"):
            shape = QWEN35_EIGHTH if name == "qwen35-eighth" else QWEN35_08B
            config = Qwen3_5TextConfig(**shape, max_position_embeddings=65536, pad_token_id=0, bos_token_id=1,
                                       eos_token_id=2)
            model = Qwen3_5ForCausalLM(config)
        elif name in ("esm2-650m", "esm2-8m"):
            model = EsmModel(EsmConfig(**(ESM2_650M if name == "esm2-650m" else ESM2_8M)), add_pooling_layer=False)
        else:
            raise SystemExit(f"unknown model {name}")
    model.to(dtype).save_pretrained(path)
    tokenizer = demo_model.build_tokenizer()
    tokenizer.model_max_length = 1024 if name.startswith("esm") else 65536
    tokenizer.save_pretrained(path)
    del model
    return path


def sequences(n: int, tokenizer, max_len: int) -> list[list[int]]:
    fasta = Path(tempfile.mkdtemp()) / "bench.fasta"
    subprocess.run([sys.executable, str(REPO / "tools" / "make_fasta.py"), "--n", str(n), "--seed", "1",
                    str(fasta)], check=True, capture_output=True)
    records = fasta.read_text().split(">")[1:]
    texts = ["".join(r.split("\n")[1:]) for r in records]
    ids = tokenizer(texts, add_special_tokens=True)["input_ids"]
    ids = [x[:max_len] for x in ids]
    return sorted(ids, key=len, reverse=True)


def load_engine(kind: str, path: Path, device: torch.device, dtype: torch.dtype, budget: int, max_seqs: int):
    if kind == "hf":
        from pipeline.engine.hf import HFEngine
        return HFEngine(str(path), device, dtype, logprobs=False)
    from pipeline.engine.native import NativeEngine
    return NativeEngine.load(str(path), device, dtype, "", max_tokens_per_step=budget, max_seqs=max_seqs,
                             batch_invariant=kind != "native-variant")


def embed(engine, batch_ids, kind: str, budget: int, max_seqs: int, device: torch.device) -> float:
    """Seconds to embed `batch_ids` (mean of the final hidden state, copied to the host), batched as a
    worker batches them."""
    lengths = np.array([len(x) for x in batch_ids])
    final = engine.info.num_layers
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = CLOCK[0]()
    for a, b in plan_batches(lengths, budget, max_seqs, padded=kind == "hf"):
        out = engine.forward(batch_ids[a:b], [final], False)
        h, cu = out.hidden[final].float(), out.cu_seqlens
        seg = torch.repeat_interleave(torch.arange(b - a, device=h.device), cu[1:] - cu[:-1])
        pooled = torch.zeros(b - a, h.shape[1], device=h.device).index_add_(0, seg, h) / (cu[1:] - cu[:-1])[:, None]
        pooled.cpu()
    sync()
    return CLOCK[0]() - start


def embed_interleaved(engines: dict, ids, budget: int, max_seqs: int, device: torch.device,
                      slices: int = 40) -> dict[str, float]:
    """Seconds per engine over all of `ids`, the engines taking turns on consecutive slices of the
    (length-sorted) sequences, so that a shared machine's changing load hits every engine alike."""
    seconds = {kind: 0.0 for kind in engines}
    for kind, engine in engines.items():   # warm-up, not timed
        engine.forward(ids[-min(len(ids), 8):], [engine.info.num_layers], False)
    slices = max(1, min(slices, len(ids) // 200))   # a slice holds enough sequences for full batches
    bounds = np.linspace(0, len(ids), slices + 1).astype(int)
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        order = list(engines) if i % 2 == 0 else list(engines)[::-1]
        for kind in order:
            seconds[kind] += embed(engines[kind], ids[a:b], kind, budget, max_seqs, device)
    return seconds


def long_sequence(engine, n_tokens: int, device: torch.device) -> str:
    """Embed one n_tokens-long sequence on the native engine: seconds and peak GPU memory."""
    ids = [1] + list(np.random.default_rng(0).integers(4, 29, n_tokens - 2)) + [2]
    torch.cuda.reset_peak_memory_stats(device)
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = engine.forward([ids], [engine.info.num_layers], False)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    ok = bool(torch.isfinite(out.hidden[engine.info.num_layers]).all())
    return f"{n_tokens} tokens in {seconds:.2f} s, peak GPU memory {peak:.1f} GiB, finite: {ok}"


def mkl_default_mode() -> str:
    """MKL in its default mode for the whole run (it computes once before anything could set strict mode),
    with the native engine told that its matmuls keep batch invariance all the same, so that it still runs
    its batch-invariant code and the two runs differ in MKL's mode alone (timing only: rows may differ)."""
    from pipeline.engine import config as engine_config, mkl_cnr
    torch.ones(2, 2) @ torch.ones(2, 2)
    mode = mkl_cnr.MatmulMode(True, "MKL in its default mode (--mkl-default)")
    engine_config.strict_matmuls = lambda: mode
    return mode.text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("device", choices=["cpu", "gpu"])
    parser.add_argument("--n", type=int, default=None, help="sequences (default 20000 on CPU, 50000 on GPU)")
    parser.add_argument("--models", default=None, help="comma-separated: demo, qwen35-eighth, esm2-8m (CPU); qwen35-0.8b, esm2-650m (GPU)")
    parser.add_argument("--engines", default="hf,native",
                        help="comma-separated: hf, native (batch-invariant, the default), native-variant "
                             "(--no-batch-invariant: what the property costs)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (a CPU worker runs 1 by default)")
    parser.add_argument("--max-tokens-per-batch", type=int, default=None, help="default: the pipeline's (4096 CPU, 32768 GPU)")
    parser.add_argument("--max-seqs", type=int, default=256)
    parser.add_argument("--long", type=int, default=32768, help="GPU: tokens of the single long sequence (0: skip)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="model dtype (default: bfloat16 on GPU, float32 on CPU, as a run's --dtype auto)")
    parser.add_argument("--keep-denormals", action="store_true",
                        help="do not flush float denormals to zero (workers do; this measures what that gains)")
    parser.add_argument("--slice", default=None, metavar="A:B",
                        help="only sequences A..B-1 of the --n generated, longest first (e.g. 0:300, the longest 300)")
    parser.add_argument("--delta-chunk-size", type=int, default=None,
                        help="CPU: the native delta rule's chunk size instead of pipeline's CPU_CHUNK_SIZE")
    parser.add_argument("--default-malloc", action="store_true",
                        help="CPU: leave glibc malloc at its defaults instead of keeping freed memory, as workers do")
    parser.add_argument("--mkl-default", action="store_true",
                        help="CPU: leave MKL in its default mode instead of strict CNR mode, as workers set it "
                             "(measures what strict mode costs; the native engine still runs batch-invariant)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="time with wall time or this process's CPU time (cpu: for 1 thread on a shared machine)")
    parser.add_argument("--out", default=None, help="also write the table here")
    args = parser.parse_args()
    if args.clock == "cpu":
        CLOCK[0] = time.process_time

    gpu = args.device == "gpu"
    if gpu and not torch.cuda.is_available():
        raise SystemExit("gpu benchmark: no CUDA device visible")
    device = torch.device("cuda:0" if gpu else "cpu")
    dtype = getattr(torch, args.dtype) if args.dtype else torch.bfloat16 if gpu else torch.float32
    from pipeline.worker.cpu_setup import keep_freed_memory, set_cpu_threads, set_strict_matmuls
    matmuls = "" if gpu else mkl_default_mode() if args.mkl_default else set_strict_matmuls().text
    flushing = set_cpu_threads(args.threads, not args.keep_denormals)   # as a worker does, for every engine
    keeping = not gpu and not args.default_malloc and keep_freed_memory()
    if args.delta_chunk_size:
        import pipeline.models.layers.gated_deltanet as gdn
        gdn.CPU_CHUNK_SIZE = args.delta_chunk_size
    first, _, stop = (args.slice or ":").partition(":")
    n = args.n or (50000 if gpu else 20000)
    budget = args.max_tokens_per_batch or (32768 if gpu else 4096)
    models = (args.models or ("qwen35-0.8b,esm2-650m" if gpu else "demo,qwen35-eighth")).split(",")
    kinds = args.engines.split(",")
    from pipeline.models.hf_config import quiet_transformers
    quiet_transformers()

    lines = [f"device: {torch.cuda.get_device_name(0) if gpu else f'CPU, {args.threads} thread(s)'}; "
             f"dtype {str(dtype).removeprefix('torch.')}; {n} make_fasta.py sequences (seed 1); "
             f"token budget {budget}, max {args.max_seqs} sequences per batch; torch {torch.__version__}; "
             f"denormals {'flushed' if flushing else 'kept'}"
             + ("" if gpu else f"; malloc {'keeps freed memory' if keeping else 'defaults'}; matmuls: {matmuls}")
             + (f"; sequences {args.slice} of the sorted {n}" if args.slice else "")
             + (f"; native delta-rule chunk {args.delta_chunk_size}" if args.delta_chunk_size else "")
             + ("; seconds are CPU time" if args.clock == "cpu" else ""),
             "", "| model | engine | sequences | tokens | seconds | tok/s | vs hf |", "| --- | --- | --- | --- | --- | --- | --- |"]
    notes = []
    if gpu:
        try:
            import fla  # noqa: F401
            notes.append("hf engine: flash-linear-attention (fla-core) installed: its Qwen3.5 path uses fla's kernels")
        except ImportError:
            notes.append("hf engine: fla-core NOT installed: its Qwen3.5 delta rule runs transformers' torch fallback")
    for name in models:
        path = write_checkpoint(name, Path(tempfile.mkdtemp()) / name, dtype, device)
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(path)
        ids = sequences(n, tokenizer, tokenizer.model_max_length)
        ids = ids[int(first or 0):int(stop) if stop else None]
        engines = {kind: load_engine(kind, path, device, dtype, budget, args.max_seqs) for kind in kinds}
        tokens = sum(map(len, ids))
        seconds = embed_interleaved(engines, ids, budget, args.max_seqs, device)
        for kind in kinds:
            rate = tokens / seconds[kind]
            speedup = f"{rate / (tokens / seconds['hf']):.2f}x" if "hf" in seconds else ""
            lines.append(f"| {name} | {kind} | {len(ids)} | {tokens} | {seconds[kind]:.1f} | {rate:,.0f} | {speedup} |")
            print(lines[-1], flush=True)
            engine = engines[kind]
            if gpu and kind == "native" and args.long and name.startswith("qwen35"):
                notes.append(f"{name} native, one long sequence: {long_sequence(engine, args.long, device)}")
            if hasattr(engine, "stats_line"):
                notes.append(f"{name} {kind}: {engine.stats_line()}")
        if "native" in seconds and "native-variant" in seconds:
            notes.append(f"{name}: batch invariance costs {seconds['native'] / seconds['native-variant'] - 1:+.1%} "
                         "of native's time (native vs native-variant)")
        del engines
        gc.collect()
        if gpu:
            torch.cuda.empty_cache()
    text = "\n".join(lines + [""] + [f"- {x}" for x in notes]) + "\n"
    print("\n" + text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
