"""Native engine vs hf engine: embed throughput (tokens/s) on the same sequences, in one run.

    python bench/bench_engine.py cpu                     # demo model + Qwen3.5 at ~1/8 of 0.8B, 20k sequences
    python bench/bench_engine.py cpu --n 2000 --models qwen35-eighth --threads 2
    python bench/bench_engine.py gpu                     # Qwen3.5-0.8B-shaped and ESM-2-650M-shaped, bf16, 2,000
                                                         # sequences, plus one 32k-token sequence (native)
    python bench/bench_engine.py gpu --models qwen35-0.8b [--fla-backend triton|flash_qla]   # ~1-2 min on an H100
    python bench/bench_engine.py gpu --smoke             # the GPU run's code on the CPU, toy sizes (a test runs it)

Everything prints as it happens (flushed): each phase with its seconds (checkpoint, sequences, engine loads, a
warm-up batch per engine that compiles the kernels and is not counted), each slice of the timed run, each
engine's row, the long sequence (a first call that compiles, then a timed one). A GPU run builds its random
checkpoint on the GPU in the run's dtype, and says which fla backend the hf engine's Qwen3.5 runs on.

`--engines hf,native,native-variant` also times the native engine without batch invariance
(--no-batch-invariant), the engines taking turns as below; `native-unfused` runs the Triton path's layers without
their fused elementwise kernels (the model's `fuse_elementwise` off: ESM's and the RMS-norm families'), and
`native-split` the delta rule's split design (docs/kernels/gated_delta_rule.md), e.g. `--engines
hf,native,native-unfused,native-split --models qwen35-0.8b` on a GPU. On CPU the process first puts MKL in strict
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
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))   # (bench_gated_delta_rule's fla helpers, when imported from elsewhere)

from bench.scratch import scratch_folder  # noqa: E402
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
# --smoke's model: Qwen3.5's layer pattern (three delta-rule layers, then gated attention) at toy sizes.
QWEN35_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                   linear_key_head_dim=16, linear_value_head_dim=16, vocab_size=32, tie_word_embeddings=True)
QWEN35_SHAPES = {"qwen35-0.8b": QWEN35_08B, "qwen35-eighth": QWEN35_EIGHTH, "qwen35-tiny": QWEN35_TINY}


def say(*lines: str) -> None:
    """Print now (flushed: the output may be all a lent GPU's run leaves) and keep for --out."""
    for line in lines:
        OUTPUT.append(line)
        print(line, flush=True)


OUTPUT: list[str] = []


def write_checkpoint(name: str, path: Path, dtype: torch.dtype, device: torch.device) -> Path:
    """A checkpoint directory for `name` (random weights), with the demo's protein tokenizer. The model is built
    on `device` in `dtype` (on a GPU: no float32 copy on the host, nothing converted), then saved."""
    if name == "demo":
        return demo_model.write(path)
    from transformers import EsmConfig, EsmModel, Qwen3_5ForCausalLM, Qwen3_5TextConfig
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            if name in QWEN35_SHAPES:
                config = Qwen3_5TextConfig(**QWEN35_SHAPES[name], max_position_embeddings=65536, pad_token_id=0,
                                           bos_token_id=1, eos_token_id=2)
                model = Qwen3_5ForCausalLM(config)
            elif name in ("esm2-650m", "esm2-8m"):
                model = EsmModel(EsmConfig(**(ESM2_650M if name == "esm2-650m" else ESM2_8M)), add_pooling_layer=False)
            else:
                raise SystemExit(f"unknown model {name}")
    finally:
        torch.set_default_dtype(default_dtype)
    model.to(dtype).save_pretrained(path)
    tokenizer = demo_model.build_tokenizer()
    tokenizer.model_max_length = 1024 if name.startswith("esm") else 65536
    tokenizer.save_pretrained(path)
    del model
    return path


def sequences(n: int, tokenizer, max_len: int) -> list[list[int]]:
    with tempfile.TemporaryDirectory(prefix="bench_engine_fasta_") as folder:
        fasta = Path(folder) / "bench.fasta"
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
    if kind not in NATIVE_KINDS:
        raise SystemExit(f"--engines: unknown engine {kind!r} (hf, {', '.join(NATIVE_KINDS)})")
    delta = {"gdn_launch": {"chunk_gated_delta_rule": {"design": "split"}}} if kind == "native-split" else {}
    engine = NativeEngine.load(str(path), device, dtype, "", max_tokens_per_step=budget, max_seqs=max_seqs,
                               batch_invariant=kind != "native-variant", **delta)
    if kind == "native-unfused":   # the Triton path's layers without their fused elementwise kernels
        engine.model.fuse_elementwise = False
    return engine


# The native engine as a run uses it, and the variants a GPU session compares it with.
NATIVE_KINDS = ("native", "native-variant", "native-unfused", "native-split")


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


def warm_up(engines: dict, ids, budget: int, max_seqs: int, device: torch.device) -> None:
    """One batch per engine before the timed run (kernels compile, caches allocate), its seconds printed apart:
    the longest sequences up to a full token budget (the shapes the run starts with), then the 8 shortest."""
    longest = []
    for x in ids:
        if sum(map(len, longest)) + len(x) > budget or len(longest) == max_seqs:
            break
        longest.append(x)
    for kind, engine in engines.items():
        took = embed(engine, (longest or ids[:1]) + ids[-min(len(ids), 8):], kind, budget, max_seqs, device)
        say(f"warm-up (not counted): {kind} {took:.1f} s")


def embed_interleaved(engines: dict, ids, budget: int, max_seqs: int, device: torch.device,
                      slices: int = 40) -> dict[str, float]:
    """Seconds per engine over all of `ids`, the engines taking turns on consecutive slices of the
    (length-sorted) sequences, so that a shared machine's changing load hits every engine alike. Each
    slice's seconds are printed when it is done."""
    seconds = {kind: 0.0 for kind in engines}
    slices = max(1, min(slices, len(ids) // 200))   # a slice holds enough sequences for full batches
    bounds = np.linspace(0, len(ids), slices + 1).astype(int)
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        order = list(engines) if i % 2 == 0 else list(engines)[::-1]
        took = {}
        for kind in order:
            took[kind] = embed(engines[kind], ids[a:b], kind, budget, max_seqs, device)
            seconds[kind] += took[kind]
        tokens = sum(map(len, ids[a:b]))
        say(f"slice {i + 1}/{slices}: {b - a} sequences, {tokens} tokens; "
            + ", ".join(f"{kind} {took[kind]:.2f} s" for kind in engines))
    return seconds


def long_sequence(engine, n_tokens: int, device: torch.device) -> str:
    """Embed one n_tokens-long sequence on the native engine twice: the first call (new kernel variants
    compile: a lone long sequence walks in narrower blocks) and a timed second one, with the peak GPU memory."""
    ids = [1] + [int(x) for x in np.random.default_rng(0).integers(4, 29, n_tokens - 2)] + [2]
    gpu = device.type == "cuda"
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    seconds = []
    for _ in range(2):
        if gpu:
            torch.cuda.reset_peak_memory_stats(device)
        sync()
        start = time.perf_counter()
        out = engine.forward([ids], [engine.info.num_layers], False)
        sync()
        seconds.append(time.perf_counter() - start)
    memory = f", peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB" if gpu else ""
    ok = bool(torch.isfinite(out.hidden[engine.info.num_layers]).all())
    return (f"{n_tokens} tokens in {seconds[1]:.2f} s ({n_tokens / seconds[1]:,.0f} tok/s; first call, with "
            f"compiles, {seconds[0]:.2f} s){memory}, finite: {ok}")


def fla_line() -> str:
    """Which fla-core the hf engine's Qwen3.5 runs on (transformers sends its delta rule to fla when it imports)."""
    from bench_gated_delta_rule import fla_backend_line, load_fla
    fla_chunk, _, name = load_fla()
    return "hf engine: " + fla_backend_line(name, fla_chunk is not None) + (
        "" if fla_chunk is not None else ": its Qwen3.5 delta rule runs transformers' torch fallback")


def mkl_default_mode() -> str:
    """MKL in its default mode for the whole run (it computes once before anything could set strict mode),
    with the native engine told that its matmuls keep batch invariance all the same, so that it still runs
    its batch-invariant code and the two runs differ in MKL's mode alone (timing only: rows may differ)."""
    from pipeline.engine import config as engine_config, mkl_cnr
    torch.ones(2, 2) @ torch.ones(2, 2)
    mode = mkl_cnr.MatmulMode(True, "MKL in its default mode (--mkl-default)")
    engine_config.strict_matmuls = lambda: mode
    return mode.text


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("device", choices=["cpu", "gpu"])
    parser.add_argument("--n", type=int, default=None, help="sequences (default 20000 on CPU, 2000 on GPU)")
    parser.add_argument("--models", default=None,
                        help="comma-separated: demo, qwen35-eighth, qwen35-tiny, esm2-8m (CPU); qwen35-0.8b, esm2-650m "
                             "(GPU)")
    parser.add_argument("--engines", default="hf,native",
                        help="comma-separated: hf, native (batch-invariant, the default), native-variant "
                             "(--no-batch-invariant: what the property costs), native-unfused (no fused "
                             "elementwise kernels), native-split (the delta rule's split design)")
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
    parser.add_argument("--smoke", action="store_true",
                        help="gpu: run the GPU benchmark's code on the CPU at toy sizes (a Qwen3.5 of 4 tiny layers, "
                             "40 sequences cut to 120 tokens, steps of 1,024, a 600-token long one): checks the "
                             "script, its numbers mean nothing")
    parser.add_argument("--fla-backend", choices=["triton", "flash_qla"], default="triton",
                        help="gpu: what fla-core runs for the hf engine's Qwen3.5: its Triton kernels or FlashQLA")
    args = parser.parse_args(argv)
    if args.clock == "cpu":
        CLOCK[0] = time.process_time

    gpu = args.device == "gpu" and not args.smoke
    if gpu and not torch.cuda.is_available():
        raise SystemExit("gpu benchmark: no CUDA device visible (--smoke runs its code on the CPU)")
    if args.device == "gpu":
        from bench_gated_delta_rule import set_fla_backend
        set_fla_backend(args.fla_backend)   # before transformers imports fla
    if args.smoke:
        args.n = args.n or 40
        args.models = args.models or "qwen35-tiny"
        args.long = min(args.long, 600)
        args.max_tokens_per_batch = args.max_tokens_per_batch or 1024
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
    n = args.n or (2000 if gpu else 20000)
    budget = args.max_tokens_per_batch or (32768 if args.device == "gpu" else 4096)
    models = (args.models or ("qwen35-0.8b,esm2-650m" if gpu else "demo,qwen35-eighth")).split(",")
    kinds = args.engines.split(",")
    from pipeline.models.hf_config import quiet_transformers
    quiet_transformers()

    where = torch.cuda.get_device_name(0) if gpu else f"CPU, {args.threads} thread(s)"
    say(f"device: {where}{' (--smoke: the GPU run on the CPU, toy sizes)' if args.smoke else ''}; "
        f"dtype {str(dtype).removeprefix('torch.')}; {n} make_fasta.py sequences (seed 1); "
        f"token budget {budget}, max {args.max_seqs} sequences per batch; torch {torch.__version__}; "
        f"denormals {'flushed' if flushing else 'kept'}"
        + ("" if args.device == "gpu" else f"; malloc {'keeps freed memory' if keeping else 'defaults'}; "
           f"matmuls: {matmuls}")
        + (f"; sequences {args.slice} of the sorted {n}" if args.slice else "")
        + (f"; native delta-rule chunk {args.delta_chunk_size}" if args.delta_chunk_size else "")
        + ("; seconds are CPU time" if args.clock == "cpu" else ""))
    if args.device == "gpu":
        say(fla_line())
    header = ["| model | engine | sequences | tokens | seconds | tok/s | vs hf |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for name in models:
        start = time.perf_counter()
        path = write_checkpoint(name, scratch_folder(f"bench_engine_{name}_") / name, dtype, device)
        say(f"{name}: checkpoint built on {device.type} and saved in {time.perf_counter() - start:.1f} s")
        start = time.perf_counter()
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(path)
        ids = sequences(n, tokenizer, min(tokenizer.model_max_length, 120 if args.smoke else 1 << 30))
        ids = ids[int(first or 0):int(stop) if stop else None]
        tokens = sum(map(len, ids))
        say(f"{name}: {len(ids)} sequences, {tokens} tokens, made and tokenized in {time.perf_counter() - start:.1f} s")
        engines = {}
        for kind in kinds:
            start = time.perf_counter()
            engines[kind] = load_engine(kind, path, device, dtype, budget, args.max_seqs)
            say(f"{name}: {kind} engine loaded in {time.perf_counter() - start:.1f} s")
        warm_up(engines, ids, budget, args.max_seqs, device)
        seconds = embed_interleaved(engines, ids, budget, args.max_seqs, device)
        say("", *header)
        for kind in kinds:
            rate = tokens / seconds[kind]
            speedup = f"{rate / (tokens / seconds['hf']):.2f}x" if "hf" in seconds else ""
            say(f"| {name} | {kind} | {len(ids)} | {tokens} | {seconds[kind]:.1f} | {rate:,.0f} | {speedup} |")
        say("")
        for kind in kinds:
            engine = engines[kind]
            if args.device == "gpu" and kind == "native" and args.long and name.startswith("qwen35"):
                say(f"- {name} native, one long sequence: {long_sequence(engine, args.long, device)}")
            if hasattr(engine, "stats_line"):
                say(f"- {name} {kind}: {engine.stats_line()}")
        if "native" in seconds and "native-variant" in seconds:
            say(f"- {name}: batch invariance costs {seconds['native'] / seconds['native-variant'] - 1:+.1%} "
                "of native's time (native vs native-variant)")
        del engines
        gc.collect()
        shutil.rmtree(path.parent, ignore_errors=True)   # the next model's checkpoint beside it would not fit some disks
        if gpu:
            torch.cuda.empty_cache()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(OUTPUT) + "\n")


if __name__ == "__main__":
    main()
