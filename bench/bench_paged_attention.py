"""Benchmark paged_attention on a GPU: prefill beside SDPA flash, decode bandwidth, ESM-like encoder batches.

    python bench/bench_paged_attention.py --out bench/out/paged_attention.md     # GPU, bfloat16
    python bench/bench_paged_attention.py --smoke                                # tiny shapes on CPU

Times are medians of triton.testing.do_bench (warm-up excluded, L2 flushed between runs). Every call
uses the default launch rule (launch.default_launch), shown per row. Decode byte model: K and V bytes of
every sequence's kv_len positions, plus q and out; the block table and the split-KV partials are left
out (the partials are < 5% of the KV bytes at these shapes), so the figure is the useful bandwidth.
"""
import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from triton_kernels import paged_attention, write_kv_cache  # noqa: E402
from triton_kernels.paged_attention import default_launch  # noqa: E402
from triton_kernels._device import target_of  # noqa: E402
from triton_kernels.paged_attention.naive import naive_paged_attention  # noqa: E402

# Spec HBM bandwidth (GB/s) by device-name fragment, most specific first.
PEAK_GBPS = [("H200", 4800), ("H100 PCIe", 2000), ("H100", 3350), ("A100-SXM4-80GB", 2039), ("A100", 1555)]
LLAMA = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)  # Llama-3-8B attention
ESM = dict(num_q_heads=20, num_kv_heads=20, head_dim=64)  # ESM-2 650M


class Setup:
    def __init__(self, device: torch.device, dtype: torch.dtype, page_size: int, smoke: bool):
        self.device, self.dtype, self.page_size, self.smoke = device, dtype, page_size, smoke
        self.gen = torch.Generator(device=device).manual_seed(0)

    def time_ms(self, fn) -> float:
        if self.device.type == "cuda":
            import triton.testing

            return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        fn()
        start = time.perf_counter()
        for _ in range(3):
            fn()
        return (time.perf_counter() - start) / 3 * 1e3

    def paged_batch(self, seqs, num_q_heads, num_kv_heads, head_dim, *, dense: bool):
        """q and a paged cache on randomly permuted pages for (q_len, kv_len) pairs.

        dense=True also returns each sequence's dense K/V (written into the cache with write_kv_cache);
        dense=False fills the cache in place (decode at 256 x 32k has no room for a second copy).
        """
        ps, dev = self.page_size, self.device
        n_pages = [math.ceil(kv / ps) for _, kv in seqs]
        num_pages = sum(n_pages)
        shape = (num_pages, ps, num_kv_heads, head_dim)
        k_cache = torch.empty(shape, device=dev, dtype=self.dtype)
        v_cache = torch.empty(shape, device=dev, dtype=self.dtype)
        order = torch.randperm(num_pages, device=dev, generator=self.gen).int()
        block_tables = torch.zeros(len(seqs), max(n_pages), device=dev, dtype=torch.int32)
        first = 0
        for s, n in enumerate(n_pages):
            block_tables[s, :n] = order[first:first + n]
            first += n
        dense_kv = []
        if dense:
            for s, (_, kv_len) in enumerate(seqs):
                k = torch.randn(kv_len, num_kv_heads, head_dim, device=dev, dtype=self.dtype, generator=self.gen)
                v = torch.randn(kv_len, num_kv_heads, head_dim, device=dev, dtype=self.dtype, generator=self.gen)
                pos = torch.arange(kv_len, device=dev)
                write_kv_cache(k, v, k_cache, v_cache, block_tables[s, pos // ps].long() * ps + pos % ps)
                dense_kv.append((k, v))
        else:
            k_cache.normal_(generator=self.gen)
            v_cache.normal_(generator=self.gen)
        q_lens = torch.tensor([q for q, _ in seqs])
        q = torch.randn(int(q_lens.sum()), num_q_heads, head_dim, device=dev, dtype=self.dtype, generator=self.gen)
        cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
        cu[1:] = q_lens.cumsum(0)
        kv_lens = torch.tensor([kv for _, kv in seqs], dtype=torch.int32)
        return (q, k_cache, v_cache, block_tables, cu.to(dev), kv_lens.to(dev)), dense_kv

    def launch_of(self, batch) -> str:
        q, k_cache, _, block_tables = batch[:4]
        if q.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            return "torch path"
        knobs = default_launch(num_q_tokens=q.shape[0], num_seqs=block_tables.shape[0], num_q_heads=q.shape[1],
                               num_kv_heads=k_cache.shape[2], head_dim=q.shape[2], page_size=k_cache.shape[1],
                               max_kv_len=block_tables.shape[1] * k_cache.shape[1],
                               target=target_of(q.device))
        return (f"bq{knobs.block_q} tile{knobs.pages_per_tile * k_cache.shape[1]} w{knobs.num_warps} "
                f"s{knobs.num_stages} split{knobs.num_kv_splits}")

    def check_vs_reference(self, batch, out, causal) -> str:
        """Smoke mode only: max |out - float64 reference|."""
        if not self.smoke:
            return "-"
        return f"{(out.double() - naive_paged_attention(*batch, causal=causal)).abs().max().item():.1e}"


def sdpa(q, k, v, *, causal, mask=None):
    """torch SDPA on [B, H, L, D]; on CUDA the flash backend unless a mask forces another."""
    gqa = q.shape[1] != k.shape[1]
    if q.is_cuda and mask is None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                          enable_gqa=gqa)


def sdpa_inputs(q, k, v, *, causal):
    """(k, v, note) that SDPA flash accepts: as given (GQA inside flash) or, where this torch's flash
    backend refuses enable_gqa, expanded to Hq heads beforehand (outside the timed region)."""
    try:
        sdpa(q, k, v, causal=causal)
        return k, v, ""
    except RuntimeError:
        group = q.shape[1] // k.shape[1]
        return k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), " (SDPA: K/V expanded to Hq)"


def bench_prefill(setup: Setup, cases) -> list[str]:
    rows = []
    for num_seqs, seq_len in cases:
        batch, dense_kv = setup.paged_batch([(seq_len, seq_len)] * num_seqs, **LLAMA, dense=True)
        q = batch[0]
        q_dense = q.view(num_seqs, seq_len, *q.shape[1:]).transpose(1, 2)
        k_dense = torch.stack([k for k, _ in dense_kv]).transpose(1, 2)
        v_dense = torch.stack([v for _, v in dense_kv]).transpose(1, 2)
        k_dense, v_dense, note = sdpa_inputs(q_dense, k_dense, v_dense, causal=True)
        out = paged_attention(*batch, causal=True)
        ref = sdpa(q_dense, k_dense, v_dense, causal=True)
        diff = (out.view(num_seqs, seq_len, *q.shape[1:]).transpose(1, 2).float() - ref.float()).abs().max().item()
        t_paged = setup.time_ms(lambda: paged_attention(*batch, causal=True, out=out))
        t_sdpa = setup.time_ms(lambda: sdpa(q_dense, k_dense, v_dense, causal=True))
        flops = 4 * num_seqs * seq_len * (seq_len + 1) / 2 * LLAMA["num_q_heads"] * LLAMA["head_dim"]
        rows.append(f"| {num_seqs} x {seq_len}{note} | {t_paged:.3f} | {t_sdpa:.3f} | {t_sdpa / t_paged:.2f} | "
                    f"{flops / t_paged / 1e9:.0f} | {flops / t_sdpa / 1e9:.0f} | {diff:.1e} | "
                    f"{setup.check_vs_reference(batch, out, True)} | {setup.launch_of(batch)} |")
    return rows


def bench_decode(setup: Setup, batches, contexts, peak_gbps) -> list[str]:
    rows = []
    elem = torch.finfo(setup.dtype).bits // 8
    for context in contexts:
        for num_seqs in batches:
            batch, _ = setup.paged_batch([(1, context)] * num_seqs, **LLAMA, dense=False)
            kv_bytes = 2 * num_seqs * context * LLAMA["num_kv_heads"] * LLAMA["head_dim"] * elem
            qo_bytes = 2 * batch[0].numel() * elem
            out = paged_attention(*batch, causal=True)
            t = setup.time_ms(lambda: paged_attention(*batch, causal=True, out=out))
            gbps = (kv_bytes + qo_bytes) / t / 1e6
            peak = f"{100 * gbps / peak_gbps:.0f}%" if peak_gbps else "-"
            rows.append(f"| {num_seqs} | {context} | {t * 1e3:.1f} | {(kv_bytes + qo_bytes) / 1e6:.1f} | "
                        f"{gbps:.0f} | {peak} | {setup.check_vs_reference(batch, out, True)} | "
                        f"{setup.launch_of(batch)} |")
            batch = out = None   # freed before the next size is allocated
            if setup.device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def bench_esm(setup: Setup, num_seqs, min_len, max_len) -> list[str]:
    lengths = torch.randint(min_len, max_len + 1, (num_seqs,), generator=torch.Generator().manual_seed(1)).tolist()
    batch, dense_kv = setup.paged_batch([(n, n) for n in lengths], **ESM, dense=True)
    q, longest = batch[0], max(lengths)
    # The padded batch SDPA gets: [B, H, longest, D] with a key padding mask (so no flash backend).
    q_pad = torch.zeros(num_seqs, longest, *q.shape[1:], device=q.device, dtype=q.dtype)
    k_pad, v_pad = torch.zeros_like(q_pad), torch.zeros_like(q_pad)
    starts = batch[4].tolist()
    for s, n in enumerate(lengths):
        q_pad[s, :n] = q[starts[s]:starts[s] + n]
        k_pad[s, :n], v_pad[s, :n] = dense_kv[s]
    q_pad, k_pad, v_pad = (t.transpose(1, 2) for t in (q_pad, k_pad, v_pad))
    mask = (torch.arange(longest, device=q.device)[None, :] < torch.tensor(lengths, device=q.device)[:, None])
    mask = mask[:, None, None, :]
    out = paged_attention(*batch, causal=False)
    ref = sdpa(q_pad, k_pad, v_pad, causal=False, mask=mask).transpose(1, 2)
    diff = max((out[starts[s]:starts[s] + n].float() - ref[s, :n].float()).abs().max().item()
               for s, n in enumerate(lengths))
    t_paged = setup.time_ms(lambda: paged_attention(*batch, causal=False, out=out))
    t_sdpa = setup.time_ms(lambda: sdpa(q_pad, k_pad, v_pad, causal=False, mask=mask))
    tokens = sum(lengths)
    flops = 4 * sum(n * n for n in lengths) * ESM["num_q_heads"] * ESM["head_dim"]
    return [f"| {num_seqs} x {min_len}-{max_len} ({tokens} tok, padded to {longest}) | {t_paged:.3f} | "
            f"{t_sdpa:.3f} | {t_sdpa / t_paged:.2f} | {tokens / t_paged / 1e3:.2f} | {flops / t_paged / 1e9:.0f} | "
            f"{diff:.1e} | {setup.check_vs_reference(batch, out, False)} | {setup.launch_of(batch)} |"]


def device_description(device: torch.device) -> tuple[str, float | None]:
    if device.type != "cuda":
        mode = "Triton interpreter" if os.environ.get("TRITON_INTERPRET") == "1" else "torch SDPA path"
        return f"CPU ({mode}; smoke shapes, times meaningless)", None
    name = torch.cuda.get_device_name(device)
    peak = next((gbps for frag, gbps in PEAK_GBPS if frag in name), None)
    return f"{name}, torch {torch.__version__}", peak


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="also write the markdown tables to this file")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, to check the script runs")
    parser.add_argument("--page-size", type=int, default=16, help="KV cache page size (default 16)")
    parser.add_argument("--peak-gbps", type=float, help="HBM peak in GB/s (default: spec value by device name)")
    args = parser.parse_args(argv)

    if args.smoke:
        device, dtype = torch.device("cpu"), torch.float32
        prefill, decode_b, decode_ctx, esm = [(2, 48)], [1, 3], [64, 200], (6, 10, 40)
    else:
        if not torch.cuda.is_available():
            parser.error("no CUDA GPU: run with --smoke on CPU")
        device, dtype = torch.device("cuda"), torch.bfloat16
        prefill, decode_b, decode_ctx, esm = [(16, 2048), (1, 32768)], [1, 16, 64, 256], [4096, 32768], (256, 100, 1000)
    setup = Setup(device, dtype, args.page_size, args.smoke)
    described, peak = device_description(device)
    peak = args.peak_gbps or peak
    lines = ["# paged_attention benchmark", "", f"Device: {described}. dtype {str(dtype)[6:]}, page size "
             f"{args.page_size}, pages randomly permuted. Launch knobs: default rule (bq = block_q, tile = keys "
             "per tile, w = num_warps, s = num_stages, split = num_kv_splits).", ""]
    lines += ["## Prefill, causal (Hq 32, Hkv 8, D 128) vs SDPA flash on the dense layout", "",
              "| batch | paged ms | SDPA ms | speed vs SDPA | paged TFLOP/s | SDPA TFLOP/s | max diff vs SDPA | "
              "max err vs fp64 | launch |", "|---|---|---|---|---|---|---|---|---|"]
    lines += bench_prefill(setup, prefill)
    lines += ["", f"## Decode (q_len 1, Hq 32, Hkv 8, D 128): bytes = K + V of all kv positions + q + out; "
              f"peak {peak or '?'} GB/s", "",
              "| batch | context | us | MB moved | GB/s | of peak | max err vs fp64 | launch |",
              "|---|---|---|---|---|---|---|---|"]
    lines += bench_decode(setup, decode_b, decode_ctx, peak)
    lines += ["", "## Bidirectional ESM-2-650M-like batch (Hq = Hkv = 20, D 64) vs SDPA on the padded batch "
              "(key padding mask)", "",
              "| batch | paged ms | SDPA ms | speed vs SDPA | paged Mtok/s | paged TFLOP/s | max diff vs SDPA | "
              "max err vs fp64 | launch |", "|---|---|---|---|---|---|---|---|---|"]
    lines += bench_esm(setup, *esm)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
