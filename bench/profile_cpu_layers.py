"""Where a CPU forward pass of a Qwen3.5-style model spends its time, per part of a delta-rule layer.

    python bench/profile_cpu_layers.py                       # 1/8 Qwen3.5, float32, denormals flushed
    python bench/profile_cpu_layers.py --keep-denormals      # the same with denormals kept
    python bench/profile_cpu_layers.py --dtype bfloat16 --matmul
    python bench/profile_cpu_layers.py --conv-block-rows 256     # or 100000: the conv unblocked
    python bench/profile_cpu_layers.py --default-malloc          # glibc malloc's defaults: page faults
    python bench/profile_cpu_layers.py --hf                      # hf's pass on the same batch, side by side
    python bench/profile_cpu_layers.py --model demo --batch longest --delta-chunk-size 16

One batch of 12 make_fasta.py sequences from a third of the way down the length-sorted list (about 4k
tokens at n=600, the CPU token budget), through the native engine, 1 thread. Wall time of each part of
every Gated DeltaNet layer (input projection, causal conv, delta rule, gated norm, output projection),
averaged over 3 passes after a warm-up, in ms per layer; then the whole pass split into MLPs, attention
layers and delta-rule layers. --batch longest takes the 4 longest sequences instead (several steps,
state carried), --batch shortest the shortest up to 4,000 tokens, --rows A:B any slice of the sorted
list. --delta-chunk-size sets the CPU delta rule's chunk size (default: the layer's CPU_CHUNK_SIZE),
--delta-group-bytes and --delta-min-group-bytes its grouping, --norm-block-bytes the norms' row
blocks. --conv-block-rows compares conv blockings, --mlp-fused the GPU's form of the MLP. --matmul adds
the GFLOP/s of one 4000 x 512 x 3584 matmul in the chosen dtype (the 1/8 model's MLP shape), the
ceiling shared by both engines. Produced the per-layer numbers quoted in docs/BENCHMARKS.md; timings
vary by about 10% from run to run on a shared machine.
"""
from __future__ import annotations

import argparse
import collections
import resource
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import bench_engine  # noqa: E402
from bench.scratch import scratch_folder  # noqa: E402
import pipeline.models.layers.gated_deltanet as gdn  # noqa: E402


def matmul_gflops(dtype: torch.dtype) -> float:
    a, w = torch.randn(4000, 512, dtype=dtype), torch.randn(3584, 512, dtype=dtype)
    for _ in range(3):
        a @ w.T
    start = time.perf_counter()
    for _ in range(10):
        a @ w.T
    return 2 * 4000 * 512 * 3584 / ((time.perf_counter() - start) / 10) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen35-eighth", help="qwen35-eighth or demo")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--keep-denormals", action="store_true")
    parser.add_argument("--n", type=int, default=600, help="sequences generated; the batch is 12 of them")
    parser.add_argument("--matmul", action="store_true")
    parser.add_argument("--hf", action="store_true", help="also split the hf engine's pass on the same batch (Qwen3.5 models)")
    parser.add_argument("--default-malloc", action="store_true",
                        help="leave glibc malloc at its defaults instead of keeping freed memory, as workers do")
    parser.add_argument("--batch", choices=["third", "longest", "shortest"], default="third",
                        help="12 sequences a third of the way down the sorted list, the 4 longest, or the "
                             "shortest up to 4,000 tokens")
    parser.add_argument("--rows", default=None, metavar="A:B",
                        help="the batch is sequences A..B-1 of the length-sorted --n instead (longest first)")
    parser.add_argument("--delta-chunk-size", type=int, default=None,
                        help="the CPU delta rule's chunk size instead of the layer's CPU_CHUNK_SIZE")
    parser.add_argument("--delta-group-bytes", type=float, default=None,
                        help="the CPU delta rule's GROUP_BYTES (sequences per group) instead of torch_path's")
    parser.add_argument("--delta-min-group-bytes", type=float, default=None,
                        help="the CPU delta rule's MIN_GROUP_BYTES (1e12: groups close at GROUP_BYTES only)")
    parser.add_argument("--norm-block-bytes", type=float, default=None,
                        help="the CPU norms' CPU_BLOCK_BYTES (rows per block; 1e12: whole tensors)")
    parser.add_argument("--mlp-fused", action="store_true",
                        help="run the MLP's gate and up as one matmul, as on GPU, instead of CPU_SPLIT_GATE_UP's two")
    parser.add_argument("--conv-block-rows", type=int, default=None,
                        help="rows per block of the CPU conv (default: pipeline's CPU_CONV_BLOCK_ROWS; 100000: unblocked)")
    args = parser.parse_args()
    from pipeline.worker.cpu_setup import keep_freed_memory, set_cpu_threads
    set_cpu_threads(1, not args.keep_denormals)
    keeping = not args.default_malloc and keep_freed_memory()
    if args.mlp_fused:
        import pipeline.models.layers.mlp as mlp
        mlp.CPU_SPLIT_GATE_UP = False
    if args.conv_block_rows:
        import triton_kernels.causal_conv.torch_path as conv_torch_path
        conv_torch_path.CPU_CONV_BLOCK_ROWS = args.conv_block_rows
    if args.delta_group_bytes:
        import triton_kernels.gated_delta_rule.torch_path as torch_path
        torch_path.GROUP_BYTES = int(args.delta_group_bytes)
    if args.delta_min_group_bytes:
        import triton_kernels.gated_delta_rule.torch_path as torch_path
        torch_path.MIN_GROUP_BYTES = int(args.delta_min_group_bytes)
    if args.norm_block_bytes:
        import pipeline.models.layers.norms as norms
        norms.CPU_BLOCK_BYTES = int(args.norm_block_bytes)
    if args.delta_chunk_size:
        gdn.CPU_CHUNK_SIZE = args.delta_chunk_size
    dtype = getattr(torch, args.dtype)
    from pipeline.models.hf_config import quiet_transformers
    from transformers import AutoTokenizer
    quiet_transformers()
    path = bench_engine.write_checkpoint(args.model, scratch_folder("profile_cpu_layers_") / args.model, dtype,
                                         torch.device("cpu"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = bench_engine.sequences(args.n, tokenizer, tokenizer.model_max_length)
    batch = ids[:4] if args.batch == "longest" else ids[len(ids) // 3: len(ids) // 3 + 12]
    if args.batch == "shortest":
        batch = []
        for seq in reversed(ids):
            if sum(map(len, batch)) + len(seq) > 4000:
                break
            batch.append(seq)
    if args.rows:
        first, _, stop = args.rows.partition(":")
        batch = ids[int(first):int(stop)]
    engine = bench_engine.load_engine("native", path, torch.device("cpu"), dtype, 4096, 256)

    spent = collections.defaultdict(float)

    gdn.chunk_gated_delta_rule = timed(spent, "delta rule", gdn.chunk_gated_delta_rule)
    gdn.GatedDeltaNet._conv = timed(spent, "conv", gdn.GatedDeltaNet._conv)
    layers = [m for m in engine.model.modules() if isinstance(m, gdn.GatedDeltaNet)]
    for m in layers:
        m.in_proj.forward = timed(spent, "input projection", m.in_proj.forward)
        m.norm.forward = timed(spent, "gated norm", m.norm.forward)
        m.out_proj.forward = timed(spent, "output projection", m.out_proj.forward)
        m.forward = timed(spent, "whole layer", m.forward)
    for m in engine.model.modules():   # every layer's two halves, for the whole-pass table
        if type(m).__name__ == "GatedMLP":
            m.forward = timed(spent, "MLP", m.forward)
        elif type(m).__name__ == "GatedAttention":
            m.forward = timed(spent, "gated attention", m.forward)
    engine.forward(batch, [engine.info.num_layers], False)
    spent.clear()
    passes = 3
    usage = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    for _ in range(passes):
        engine.forward(batch, [engine.info.num_layers], False)
    total = (time.perf_counter() - start) / passes
    after = resource.getrusage(resource.RUSAGE_SELF)
    print(f"{args.model}, {args.dtype}, denormals {'kept' if args.keep_denormals else 'flushed'}, malloc "
          f"{'keeps freed memory' if keeping else 'defaults'}, 1 thread; batch of {len(batch)} sequences, "
          f"{sum(map(len, batch))} tokens; forward {total * 1e3:.0f} ms, of which kernel (system) time "
          f"{(after.ru_stime - usage.ru_stime) / passes * 1e3:.0f} ms, "
          f"{(after.ru_minflt - usage.ru_minflt) / passes:,.0f} page faults; delta-rule chunk "
          f"{gdn.CPU_CHUNK_SIZE}\n")
    print("| part of a delta-rule layer | ms per layer |\n| --- | ---: |")
    for name in ("input projection", "conv", "delta rule", "gated norm", "output projection", "whole layer"):
        print(f"| {name} | {spent[name] / passes / len(layers) * 1e3:.1f} |")
    print("\n| whole forward pass | ms |\n| --- | ---: |")
    for name, key in (("MLPs (GEMMs)", "MLP"), ("gated attention layers", "gated attention"),
                      ("delta-rule layers", "whole layer")):
        print(f"| {name} | {spent[key] / passes * 1e3:.0f} |")
    print(f"| the rest (embeddings, norms, residuals) | {(total - sum(spent[k] for k in ('MLP', 'gated attention', 'whole layer')) / passes) * 1e3:.0f} |")
    if args.hf:
        hf_total, hf_spent = hf_profile(path, batch, dtype, passes)
        rows = (("MLPs", "MLP"), ("attention layers", "gated attention"), ("delta-rule layers", "whole layer"),
                ("... of which the delta rule", "delta rule"), ("... of which the causal conv", "conv"))
        print("\n| same batch, whole pass (ms) | hf | native |\n| --- | ---: | ---: |")
        for name, key in rows:
            print(f"| {name} | {hf_spent[key] / passes * 1e3:.0f} | {spent[key] / passes * 1e3:.0f} |")
        print(f"| forward | {hf_total * 1e3:.0f} | {total * 1e3:.0f} |")
    if args.matmul:
        print(f"\n4000 x 512 x 3584 matmul, {args.dtype}: {matmul_gflops(dtype):.0f} GFLOP/s")


def hf_profile(path, batch, dtype, passes: int):
    """The hf engine's whole pass on the same batch, split like native's: transformers' own modules and
    its torch delta rule and conv functions (what it runs on CPU without fla), timed by wrapping them."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as qwen

    spent = collections.defaultdict(float)
    qwen.torch_chunk_gated_delta_rule = timed(spent, "delta rule", qwen.torch_chunk_gated_delta_rule)
    qwen.causal_conv1d_fn = timed(spent, "conv", qwen.causal_conv1d_fn)
    engine = bench_engine.load_engine("hf", path, torch.device("cpu"), dtype, 4096, 256)
    names = {"Qwen3_5MLP": "MLP", "Qwen3_5Attention": "gated attention", "Qwen3_5GatedDeltaNet": "whole layer"}
    for m in engine.base.modules():
        if type(m).__name__ in names:
            m.forward = timed(spent, names[type(m).__name__], m.forward)
    engine.forward(batch, [engine.info.num_layers], False)
    spent.clear()
    start = time.perf_counter()
    for _ in range(passes):
        engine.forward(batch, [engine.info.num_layers], False)
    return (time.perf_counter() - start) / passes, spent


def timed(spent, name, fn):
    def run(*a, **k):
        start = time.perf_counter()
        result = fn(*a, **k)
        spent[name] += time.perf_counter() - start
        return result
    return run


if __name__ == "__main__":
    main()
