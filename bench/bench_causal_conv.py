"""Benchmark the delta-rule layers' causal conv (+SiLU) on a GPU: our Triton kernel beside the layer's torch
path and transformers' conv, at Qwen3.5-0.8B's 6,144 [q|k|v] channels.

    python bench/bench_causal_conv.py --out bench/out/causal_conv.md     # GPU, bfloat16
    python bench/bench_causal_conv.py --smoke                            # tiny shapes on CPU: checks the script

Implementations, same inputs (a column slice of a wider projection, as the layer passes it):
- ours: triton_kernels.causal_conv1d, one pass plus the window update;
- torch path: GatedDeltaNet._conv with the Triton kernels off (shifted float32 slices and fix-ups: what the
  GPU path ran before the kernel, and still what the CPU engine runs);
- transformers: causal_conv1d_fn (its torch fallback, F.conv1d) on the padded [B, C, L] batch the hf engine
  builds (only for equal lengths here: no padding waste counted against it).
Times are medians of triton.testing.do_bench. GB/s counts the bytes the op must move: read x, write out,
and read + write the windows where sequences keep them. "max err" is the largest difference from our
naive reference in float64, relative to the output's largest value.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pipeline.models.step import StepContext  # noqa: E402
from pipeline.models.layers.gated_deltanet import GatedDeltaNet  # noqa: E402
from triton_kernels import causal_conv1d  # noqa: E402
from triton_kernels._device import use_triton  # noqa: E402
from triton_kernels.causal_conv import naive_causal_conv1d  # noqa: E402

PEAK_GBPS = [("H200", 4800), ("H100 PCIe", 2000), ("H100", 3350), ("A100-SXM4-80GB", 2039), ("A100", 1555)]


class Qwen35Conv:
    """Qwen3.5-0.8B's delta-rule layer shape: 16 key and 16 value heads of 128 (conv over 6,144 channels)."""
    linear_num_key_heads, linear_num_value_heads = 16, 16
    linear_key_head_dim, linear_value_head_dim = 128, 128
    linear_conv_kernel_dim, hidden_size, rms_norm_eps = 4, 1024, 1e-6


class Smoke(Qwen35Conv):
    linear_num_key_heads = linear_num_value_heads = 2
    linear_key_head_dim = linear_value_head_dim = 8


def step_context(lengths, continues: bool, device) -> StepContext:
    q_lens = np.asarray(lengths, np.int64)
    S, T = len(lengths), int(q_lens.sum())
    rows = np.arange(S)
    z = torch.zeros(T, dtype=torch.int64, device=device)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32, device=device)
    return StepContext(input_ids=z, positions=z, cu_seqlens=cu, kv_lens=cu[1:], block_tables=cu, slot_mapping=z,
                       q_lens=q_lens, prior_lens=np.full(S, 8 if continues else 0),
                       state_read=(rows, rows) if continues else None, state_write=(rows, rows) if continues else None)


def time_ms(fn, device) -> float:
    fn()
    if device.type == "cuda":
        import triton.testing
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def bench_case(label, lengths, continues, layer, dtype, device, peak):
    C, width = layer.conv_dim, layer.kernel - 1
    S, T = len(lengths), sum(lengths)
    gen = torch.Generator(device=device).manual_seed(0)
    proj = torch.randn(T, C + 2048, generator=gen, device=device, dtype=dtype)
    x = proj[:, :C]
    pool = torch.randn(S, width, C, generator=gen, device=device, dtype=dtype)
    ctx = step_context(lengths, continues, device)
    slots = torch.arange(S, device=device) if continues else None
    reads = torch.ones(S, dtype=torch.bool, device=device) if continues else None
    elem = torch.finfo(dtype).bits // 8
    nbytes = 2 * T * C * elem + (2 * S * width * C * elem if continues else 0)

    start = pool.clone()
    ours = lambda: causal_conv1d(x, layer.conv_weight, cu_seqlens=ctx.cu_seqlens,   # noqa: E731
                                 conv_state=pool if continues else None, state_indices=slots,
                                 has_initial_state=reads)
    exact = naive_causal_conv1d(x, layer.conv_weight, cu_seqlens=ctx.cu_seqlens,
                                conv_state=start.clone() if continues else None,
                                state_indices=slots, has_initial_state=reads, dtype=torch.float64)
    scale = exact.double().abs().max().item()

    def err(out):
        return f"{(out.double() - exact.double()).abs().max().item() / scale:.1e}"

    impls = [("ours (Triton)" if use_triton(x) else "ours (naive torch: no GPU, no interpreter)", ours)]
    torch_path_ctx = step_context(lengths, continues, device)   # triton_kernels=False: the shifted-slice path
    impls.append(("torch path (float32 slices)", lambda: layer._conv(x, pool, torch_path_ctx)))
    if not continues and len(set(lengths)) == 1:
        from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn
        padded = x.reshape(S, lengths[0], C).transpose(1, 2)                   # [B, C, L] as the hf layer has it
        impls.append(("transformers causal_conv1d_fn",
                      lambda: causal_conv1d_fn(padded, layer.conv_weight, None, activation="silu")))
    rows = []
    for name, fn in impls:
        pool.copy_(start)
        out = fn()
        if out.dim() == 3:
            out = out.transpose(1, 2).reshape(T, C)
        e = err(out)
        ms = time_ms(fn, device)
        gbps = nbytes / ms / 1e6
        rows.append(f"| {label} | {name} | {ms:.3f} | {gbps:.0f} | "
                    f"{f'{100 * gbps / peak:.0f}%' if peak else '-'} | {e} |")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (checks the script; times mean nothing)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--out", help="also write the table here")
    args = parser.parse_args(argv)
    if args.smoke:
        device, dtype, config = torch.device("cpu"), torch.float32, Smoke()
        cases = [("3 x 40 prefill", [40, 40, 40], False), ("5 ragged, windows", [7, 1, 30, 2, 9], True),
                 ("decode 8", [1] * 8, True)]
    else:
        if not torch.cuda.is_available():
            parser.error("no GPU visible: run with --smoke on CPU")
        device, dtype, config = torch.device("cuda"), getattr(torch, args.dtype), Qwen35Conv()
        cases = [("8 x 4k prefill", [4096] * 8, False), ("1 x 32k prefill", [32768], False),
                 ("8 x 4k continuing (chunked prefill)", [4096] * 8, True), ("decode 256", [1] * 256, True),
                 ("decode 32", [1] * 32, True)]
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU (smoke)"
    peak = next((g for frag, g in PEAK_GBPS if frag in name), None) if device.type == "cuda" else None
    layer = GatedDeltaNet(config).to(device=device, dtype=dtype)
    torch.nn.init.normal_(layer.conv_weight, std=0.5)
    lines = [f"device: {name}; dtype {str(dtype).removeprefix('torch.')}; C = {layer.conv_dim}; torch "
             f"{torch.__version__}; peak {peak or '?'} GB/s", "",
             "| step | implementation | ms | GB/s | of peak | max err |", "|---|---|---:|---:|---:|---:|"]
    with torch.inference_mode():
        for label, lengths, continues in cases:
            lines += bench_case(label, lengths, continues, layer, dtype, device, peak)
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
