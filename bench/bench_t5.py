"""T5 encoders, native engine vs transformers' T5EncoderModel on the hf engine's batching: embed throughput
(tokens/s) on make_fasta.py protein lengths, on a ProtT5-shaped model.

    python bench/bench_t5.py cpu                          # ProtT5-XL layer shapes, 2 of its 24 layers, float32
    python bench/bench_t5.py cpu --layers 4 --n 400 --threads 2
    python bench/bench_t5.py gpu                          # ProtT5-XL whole (24 layers), bfloat16, 20k sequences
    python bench/bench_t5.py gpu --engines hf,native,native-unfused   # and the Triton path's layers unfused

The model has ProtT5-XL-U50's published config (d_model 1024, 32 heads of 128, d_ff 16,384, relu, 32
buckets to distance 128, vocabulary 128) with random weights (throughput does not depend on them) and,
on CPU, fewer layers (--layers) so that a run takes minutes. Every layer costs about the same on both
engines (transformers builds T5's bias table once per batch, but the `[batch, heads, L, L]` float mask
made from it in every layer: 3-4 s a layer on two 2,001-token sequences, 1 thread), so tokens/s scale with
about 1 / layers and the ratio hardly depends on them. Sequences are longest first, truncated to
--max-len tokens; both engines run them as a worker does (bench/bench_engine.py: batches planned by
pipeline.batching.plan_batches under one token budget, padded for hf, ragged for native, the engines
taking turns on slices of about two step budgets of the sorted sequences), the mean of the final hidden
state taken per batch.

The hf side is pipeline.engine.hf.HFEngine as a worker loads it (right-padded batch, attention mask,
unpadding): it builds transformers' T5EncoderModel, the class ProtT5's model card uses (the model registry's
hf_class for the T5 families). `native-unfused` is the native engine with its layers' fused elementwise kernels
off (the model's `fuse_elementwise`: the KV-cache write and paged walk, T5LayerNorm's passes), the same GPU
path otherwise. CPU runs put MKL in strict mode as a batch-invariant worker does (--mkl-default leaves its default mode).
"""
from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import REPO, embed, mkl_default_mode, sequences  # noqa: E402

from bench.scratch import scratch_folder  # noqa: E402

sys.path.insert(0, str(REPO))
from pipeline.models import demo as demo_model  # noqa: E402
from pipeline.engine.hf import HFEngine  # noqa: E402
from pipeline.models.hf_config import quiet_transformers  # noqa: E402

# Rostlab/prot_t5_xl_uniref50's config.json (encoder part), the number of layers left to --layers.
PROTT5_XL = dict(vocab_size=128, d_model=1024, d_kv=128, d_ff=16384, num_heads=32, relative_attention_num_buckets=32,
                 relative_attention_max_distance=128, feed_forward_proj="relu", layer_norm_epsilon=1e-6,
                 is_encoder_decoder=True, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)


def embed_alternating(engines: dict, ids, budget: int, max_seqs: int, device: torch.device) -> dict[str, float]:
    """Seconds per engine over all of `ids`, the engines taking turns (first one, then the other) on slices
    of about two step budgets of the sorted sequences: with tokens this costly, bench_engine's slices of at
    least 200 sequences would be one slice for a CPU run, and a shared machine's load would change between
    the engines' halves."""
    seconds = {kind: 0.0 for kind in engines}
    for engine in engines.values():   # warm-up, not timed
        engine.forward(ids[-min(len(ids), 8):], [engine.info.num_layers], False)
    bounds, tokens = [0], 0
    for i, seq in enumerate(ids):
        tokens += len(seq)
        if tokens >= 2 * budget:
            bounds.append(i + 1)
            tokens = 0
    if bounds[-1] != len(ids):
        bounds.append(len(ids))
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        for kind in (list(engines) if i % 2 == 0 else list(engines)[::-1]):
            seconds[kind] += embed(engines[kind], ids[a:b], kind, budget, max_seqs, device)
    return seconds


def write_checkpoint(path: Path, layers: int, dtype: torch.dtype, device: torch.device) -> Path:
    """The encoder as ProtT5's half-precision release ships it (T5EncoderModel), random weights."""
    from transformers import T5Config, T5EncoderModel
    torch.manual_seed(0)
    with torch.device(device):
        model = T5EncoderModel(T5Config(**PROTT5_XL, num_layers=layers))
    model.to(dtype).save_pretrained(path)
    demo_model.build_tokenizer().save_pretrained(path)
    del model
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("device", choices=["cpu", "gpu"])
    parser.add_argument("--n", type=int, default=None, help="sequences (default 200 on CPU, 20000 on GPU)")
    parser.add_argument("--layers", type=int, default=None, help="encoder layers (default 2 on CPU, 24 on GPU)")
    parser.add_argument("--max-len", type=int, default=2048, help="tokens per sequence at most (longer ones are cut)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (a CPU worker runs 1 by default)")
    parser.add_argument("--max-tokens-per-batch", type=int, default=None, help="default: the pipeline's (4096 CPU, 32768 GPU)")
    parser.add_argument("--max-seqs", type=int, default=256)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="default: float32 on CPU, bfloat16 on GPU")
    parser.add_argument("--mkl-default", action="store_true",
                        help="CPU: leave MKL in its default mode (as docs/BENCHMARKS.md's first T5 numbers ran)")
    parser.add_argument("--engines", default="hf,native",
                        help="comma-separated: hf, native, native-unfused (default hf,native; hf is the reference)")
    parser.add_argument("--out", default=None, help="also write the table here")
    args = parser.parse_args()
    kinds = args.engines.split(",")
    if "hf" not in kinds or not set(kinds) <= {"hf", "native", "native-unfused"}:
        parser.error(f"--engines takes hf (always: the reference), native and native-unfused, got {args.engines}")

    gpu = args.device == "gpu"
    if gpu and not torch.cuda.is_available():
        raise SystemExit("gpu benchmark: no CUDA device visible")
    device = torch.device("cuda:0" if gpu else "cpu")
    dtype = getattr(torch, args.dtype) if args.dtype else torch.bfloat16 if gpu else torch.float32
    from pipeline.worker.cpu_setup import keep_freed_memory, set_cpu_threads, set_strict_matmuls
    matmuls = "" if gpu else mkl_default_mode() if args.mkl_default else set_strict_matmuls().text
    set_cpu_threads(args.threads, True)   # as a worker does, for both engines
    if not gpu:
        keep_freed_memory()
    quiet_transformers()
    n, layers = args.n or (20000 if gpu else 200), args.layers or (24 if gpu else 2)
    budget = args.max_tokens_per_batch or (32768 if gpu else 4096)

    path = write_checkpoint(scratch_folder("bench_t5_") / "prott5", layers, dtype, device)
    from pipeline.engine.native import NativeEngine
    from transformers import AutoTokenizer
    ids = sequences(n, AutoTokenizer.from_pretrained(path), args.max_len)
    engines = {}
    for kind in kinds:
        if kind == "hf":
            engines[kind] = HFEngine(str(path), device, dtype, logprobs=False)
            continue
        engines[kind] = NativeEngine.load(str(path), device, dtype, "", max_tokens_per_step=budget,
                                          max_seqs=args.max_seqs, max_model_len=max(budget, args.max_len))
        engines[kind].model.fuse_elementwise = kind != "native-unfused"
    built = type(engines["hf"].base).__name__
    if built != "T5EncoderModel":   # the comparison is with the class ProtT5's card uses
        raise SystemExit(f"the hf engine built {built}, not T5EncoderModel")
    tokens = sum(map(len, ids))
    seconds = embed_alternating(engines, ids, budget, args.max_seqs, device)
    where = torch.cuda.get_device_name(0) if gpu else f"CPU, {args.threads} thread(s)"
    lines = [f"ProtT5-XL layer shapes, {layers} layer(s); {where}; dtype {str(dtype).removeprefix('torch.')}; "
             f"{n} make_fasta.py sequences (seed 1), at most {args.max_len} tokens; token budget {budget}, "
             f"max {args.max_seqs} sequences per batch; torch {torch.__version__}" + (f"; matmuls: {matmuls}" if matmuls else ""),
             "", "| engine | sequences | tokens | seconds | tok/s | vs hf |", "| --- | --- | --- | --- | --- | --- |"]
    for kind in engines:
        rate = tokens / seconds[kind]
        lines.append(f"| {kind} | {len(ids)} | {tokens} | {seconds[kind]:.1f} | {rate:,.0f} | "
                     f"{rate / (tokens / seconds['hf']):.2f}x |")
    notes = [f"- {kind}: {engine.stats_line()}" for kind, engine in engines.items()]
    text = "\n".join(lines + [""] + notes) + "\n"
    print("\n" + text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    del engines
    gc.collect()


if __name__ == "__main__":
    main()
