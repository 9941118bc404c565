"""Benchmark our gated delta rule against fla-core and transformers' torch reference, same inputs.

GPU (bfloat16, Qwen3.5-like shapes; fla-core installed beside, see docs/kernels/gated_delta_rule.md):
    python bench/bench_gated_delta_rule.py --out bench/out/gated_delta_rule.md
CPU smoke run (tiny shapes; proves the script runs, its numbers mean nothing):
    python bench/bench_gated_delta_rule.py --smoke --out bench/out/gated_delta_rule_smoke.md
Compile report, no GPU needed (registers, spills, shared memory of each kernel for sm_90 per knob choice):
    python bench/bench_gated_delta_rule.py --compile-report

Prefill: time (median of triton.testing.do_bench, warm-up and compilation excluded), effective TFLOP/s
and bytes under the models below, error against the torch reference. Decode: one token per sequence
through the recurrent kernel, bandwidth achieved on the state bytes read and written, against peak.
"""
from __future__ import annotations

import argparse
import inspect
import math
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing
from triton_kernels import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule  # noqa: E402
from triton_kernels._device import use_triton  # noqa: E402

CHUNK = 64
PEAK_HBM_BYTES_PER_S = {"H100 PCIe": 2.0e12, "H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12}


@dataclass(frozen=True)
class Case:
    H: int
    HV: int
    K: int
    V: int
    lengths: tuple[int, ...]  # one entry: a single sequence; more: a packed varlen batch

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    @property
    def label(self) -> str:
        kind = "single" if len(self.lengths) == 1 else f"varlen x{len(self.lengths)}"
        return f"H={self.H} HV={self.HV} K={self.K} V={self.V} T={self.tokens} {kind}"

    def flops(self) -> float:
        """Effective FLOPs of the chunked algorithm, per token and value head:
        2 (3 K V + C (3 K + 2 V)): W S, Q S, K^T Vn; and K K^T, T (K b), Q K^T, T (V b), P Vn per chunk row."""
        K, V = self.K, self.V
        return self.tokens * self.HV * 2 * (3 * K * V + CHUNK * (3 * K + 2 * V))

    def min_bytes(self, elem: int) -> float:
        """Bytes any implementation must move: q, k, v, g (fp32), beta in; o and final state out."""
        T, H, HV, K, V = self.tokens, self.H, self.HV, self.K, self.V
        return T * (2 * H * K * elem + HV * V * elem + HV * 4 + HV * elem) + T * HV * V * elem + self.state_bytes()

    def our_bytes(self, elem: int) -> float:
        """Our two kernels' HBM traffic, each tile counted once per value head (an upper bound: the
        walk's V-block programs share q, k, w, p through L2, and so may a key head's value heads).
        Prep reads q, k, v, g, beta and writes w, u, p [BT per row], gamma, q_scale, k_scale; the walk
        reads q, k, w, u, p, q_scale, k_scale and writes o; plus the final states."""
        T, HV, K, V = self.tokens, self.HV, self.K, self.V
        per_token_head = elem * (6 * K + 4 * V + 2 * CHUNK + 1) + 4 * 6
        return T * HV * per_token_head + self.state_bytes()

    def state_bytes(self) -> float:
        return len(self.lengths) * self.HV * self.K * self.V * 4


def mixed_lengths(total: int, count: int, seed: int) -> tuple[int, ...]:
    """`count` lengths summing to `total`, spread over ~2 orders of magnitude (log-normal), each >= 1."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.exp(torch.randn(count, generator=gen) * 1.2)
    lengths = (w / w.sum() * (total - count)).floor().long() + 1
    lengths[0] += total - int(lengths.sum())
    return tuple(int(x) for x in lengths)


def make_inputs(case: Case, device: str, dtype: torch.dtype, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    T = case.tokens

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    inputs = dict(
        q=randn(1, T, case.H, case.K), k=randn(1, T, case.H, case.K), v=randn(1, T, case.HV, case.V),
        g=F.logsigmoid(torch.randn(1, T, case.HV, generator=gen) + 3.0).to(device),  # float32, as Qwen3.5
        beta=torch.rand(1, T, case.HV, generator=gen).sigmoid().to(device=device, dtype=dtype),
    )
    if len(case.lengths) > 1:
        bounds = [0, *torch.tensor(case.lengths).cumsum(0).tolist()]
        inputs["cu_seqlens"] = torch.tensor(bounds, dtype=torch.int32, device=device)
    return inputs


# --- the implementations, each called as fn(inputs) -> (o, final_state) ---------------------------

def ours(inputs, **knobs):
    return chunk_gated_delta_rule(**inputs, use_qk_l2norm_in_kernel=True, output_final_state=True, **knobs)


def load_transformers_reference():
    """transformers' torch chunked function, unwrapped: with fla installed its decorator swaps in fla."""
    for name in ("qwen3_5", "qwen3_next"):
        try:
            module = __import__(f"transformers.models.{name}.modeling_{name}", fromlist=["x"])
            return inspect.unwrap(module.torch_chunk_gated_delta_rule), f"transformers {name}"
        except (ImportError, AttributeError):
            continue
    return None, "transformers: no torch_chunk_gated_delta_rule found"


def make_transformers_fn(reference):
    def run(inputs):
        cu = inputs.get("cu_seqlens")
        tensors = {name: inputs[name] for name in ("q", "k", "v", "g", "beta")}
        if cu is None:
            return reference(tensors["q"], tensors["k"], tensors["v"], g=tensors["g"], beta=tensors["beta"],
                             use_qk_l2norm_in_kernel=True, output_final_state=True)
        outs, states = [], []  # no varlen support: one call per sequence
        bounds = cu.tolist()
        for a, b in zip(bounds, bounds[1:]):
            o, s = reference(*(tensors[n][:, a:b] for n in ("q", "k", "v")), g=tensors["g"][:, a:b],
                             beta=tensors["beta"][:, a:b], use_qk_l2norm_in_kernel=True, output_final_state=True)
            outs.append(o)
            states.append(s)
        return torch.cat(outs, dim=1), torch.cat(states)
    return run


def load_fla():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent
        import fla
        return fla_chunk, fla_recurrent, f"fla-core {getattr(fla, '__version__', '?')}"
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available", reported as such
        return None, None, f"fla-core not importable ({type(exc).__name__}: {exc}); pip install it to compare"


def make_fla_fn(fla_fn, inputs, reference_o, **extra):
    """fla with value heads > key heads: native if this fla version supports it (checked against our
    output), else q and k repeated to HV heads outside the timed call (what older fla layers did)."""
    cu = inputs.get("cu_seqlens")
    cu = None if cu is None else cu.long()  # fla documents a LongTensor

    def call(q, k):
        return lambda inp: fla_fn(q=q, k=k, v=inp["v"], g=inp["g"], beta=inp["beta"], cu_seqlens=cu,
                                  use_qk_l2norm_in_kernel=True, output_final_state=True, **extra)
    native = call(inputs["q"], inputs["k"])
    try:
        if rel_rms(native(inputs)[0], reference_o) < 2e-2:
            return native, "fla-core"
    except Exception:  # noqa: BLE001 - fall back to the repeated layout below
        pass
    group = inputs["v"].shape[2] // inputs["q"].shape[2]
    repeated = (inputs[n].repeat_interleave(group, dim=2) for n in ("q", "k"))
    return call(*repeated), "fla-core (q, k repeated to HV heads)"


def rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.float(), ref.float()
    return ((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


def time_ms(fn, device: str) -> float:
    fn()  # compile / autotune outside the timing
    if device == "cuda":
        from triton.testing import do_bench
        return do_bench(fn, warmup=25, rep=100, return_mode="median")
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


# --- the two benchmarks ---------------------------------------------------------------------------

def bench_prefill(cases, device, dtype, torch_max_tokens, fla_chunk, block_vs):
    reference, ref_name = load_transformers_reference()
    hf = make_transformers_fn(reference) if reference else None
    elem = torch.finfo(dtype).bits // 8
    rows = ["| shape | implementation | time (ms) | TFLOP/s | GB moved (model) | GB/s | rel. RMS vs torch ref "
            "| speed vs fla |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for case in cases:
        inputs = make_inputs(case, device, dtype)
        o_ours, _ = ours(inputs)
        if device == "cuda":
            impls = [(f"ours (block_v={bv})", lambda inp, bv=bv: ours(inp, block_v=bv), case.our_bytes(elem))
                     for bv in block_vs]
        else:
            where = "Triton interpreter" if use_triton(inputs["q"]) else "torch path"
            impls = [(f"ours ({where})", ours, case.our_bytes(elem))]
        if fla_chunk is not None:
            fla_fn, fla_name = make_fla_fn(fla_chunk, inputs, o_ours)
            impls.append((fla_name, fla_fn, case.min_bytes(elem)))
        o_ref = None
        if hf is not None and case.tokens <= torch_max_tokens:
            o_ref, _ = hf(inputs)
            impls.append((f"{ref_name} (torch)", hf, case.min_bytes(elem)))
        results = []
        for name, fn, nbytes in impls:
            ms = time_ms(lambda: fn(inputs), device)
            err = f"{rel_rms(fn(inputs)[0], o_ref):.1e}" if o_ref is not None else "-"
            results.append((name, ms, nbytes, err))
        fla_ms = next((ms for name, ms, _, _ in results if name.startswith("fla")), None)
        for name, ms, nbytes, err in results:
            vs_fla = f"{fla_ms / ms:.2f}x" if fla_ms and not name.startswith("fla") else "-"
            rows.append(f"| {case.label} | {name} | {ms:.3f} | {case.flops() / ms / 1e9:.3g} | "
                        f"{nbytes / 1e9:.3f} | {nbytes / ms / 1e6:.0f} | {err} | {vs_fla} |")
        if hf is not None and o_ref is None:
            rows.append(f"| {case.label} | torch reference | skipped (> {torch_max_tokens} tokens) | | | | | |")
        inputs = o_ours = o_ref = None   # freed before the next case is allocated
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def bench_decode(cases, device, dtype, fla_recurrent, peak):
    rows = ["| shape | implementation | time (us) | state GB/s | % of peak HBM |", "|---|---|---:|---:|---:|"]
    for case in cases:
        N = len(case.lengths)
        inputs = make_inputs(case, device, dtype, seed=1)
        h0 = torch.randn(N, case.HV, case.K, case.V, device=device)
        state_bytes = 2 * case.state_bytes()  # read and written once
        def run_ours(inp=inputs):
            return fused_recurrent_gated_delta_rule(**inp, initial_state=h0, output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True)
        where = "" if device == "cuda" else " (interpreter)" if use_triton(h0) else " (torch path)"
        impls = [("ours" + where, run_ours)]
        if fla_recurrent is not None:
            fla_fn, fla_name = make_fla_fn(fla_recurrent, inputs, run_ours()[0], initial_state=h0)
            impls.append((fla_name + " fused_recurrent", lambda inp=inputs, f=fla_fn: f(inp)))
        label = f"H={case.H} HV={case.HV} K={case.K} V={case.V} decode N={N}"
        for name, fn in impls:
            try:
                ms = time_ms(fn, device)
            except Exception as exc:  # noqa: BLE001 - a peer failing on a shape is a result, not a crash
                rows.append(f"| {label} | {name} | failed: {type(exc).__name__} | | |")
                continue
            gbps = state_bytes / ms / 1e6
            pct = f"{100 * gbps * 1e9 / peak:.0f}%" if peak else "-"
            rows.append(f"| {label} | {name} | {ms * 1e3:.1f} | {gbps:.0f} | {pct} |")
    return rows


def compile_report(arch: int) -> list[str]:
    """Compile the kernels for `arch` (e.g. 90) without a GPU and report their resources: a spill
    (local-memory stack) in the sequential walk is the first thing to rule out when tuning knobs."""
    import os
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from triton_kernels.gated_delta_rule import chunk, fused_recurrent

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    fp32_args = {"g", "gamma", "q_scale", "k_scale", "h0", "ht"}
    int_args = {"chunk_bounds", "seq_bounds", "seq_ranges", "seq_order"}

    def build(kernel, dt, consts, num_warps, num_stages):
        constexpr_names = {kernel.arg_names[i] for i in kernel.constexprs}
        sig = {}
        for name in kernel.arg_names:
            if name in constexpr_names:
                sig[name] = "constexpr"
            elif name == "scale":
                sig[name] = "fp32"
            else:
                sig[name] = "*fp32" if name in fp32_args else "*i32" if name in int_args else f"*{dt}"
        # Real launches specialise 16-byte-aligned pointers; without it nothing vectorises.
        attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t.startswith("*")}
        compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs),
                                  target=GPUTarget("cuda", arch, 32),
                                  options=dict(num_warps=num_warps, num_stages=num_stages))
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        os.unlink(f.name)
        m = re.search(r"REG:(\d+).*?STACK:(\d+)", usage, re.S)
        return (m.group(1), m.group(2)) if m else ("?", "?"), compiled.metadata.shared

    rows = ["| kernel | dtype | K=V | knobs | registers | spill stack (B) | shared (KB) |",
            "|---|---|---|---|---:|---:|---:|"]
    for dt in ("bf16", "fp32"):
        prec = "ieee" if dt == "fp32" else "tf32"
        for D in (128, 64):
            for nw in (4, 8):
                consts = dict(H=2, HV=8, K=D, V=D, BT=64, BK=D, BVALL=D, USE_L2NORM=True, DOT_PREC=prec)
                (regs, stack), shared = build(chunk._chunk_prep_kernel, dt, consts, nw, 1)
                rows.append(f"| prep | {dt} | {D} | prep_num_warps={nw} | {regs} | {stack} | {shared / 1024:.0f} |")
            for bv, nw, ns in ((64, 4, 2), (32, 4, 2), (64, 8, 2), (64, 4, 1), (128, 8, 2)):
                if bv > D:
                    continue
                consts = dict(H=2, HV=8, K=D, V=D, BT=64, BK=D, BV=bv, NV=D // bv, USE_H0=True, STORE_HT=True,
                              DOT_PREC=prec, USE_U=True, WRITE_O=True)
                (regs, stack), shared = build(chunk._chunk_walk_kernel, dt, consts, nw, ns)
                rows.append(f"| walk | {dt} | {D} | block_v={bv} num_warps={nw} num_stages={ns} | {regs} | {stack} "
                            f"| {shared / 1024:.0f} |")
            if dt != "fp32":
                for bv, nw in ((32, 4), (16, 4), (32, 2)):
                    consts = dict(H=2, HV=8, K=D, V=D, BK=D, BV=bv, NV=D // bv, USE_L2NORM=True, USE_H0=True,
                                  STORE_HT=True)
                    (regs, stack), shared = build(fused_recurrent._recurrent_kernel, dt, consts, nw, 1)
                    rows.append(f"| recurrent | {dt} | {D} | block_v={bv} num_warps={nw} | {regs} | {stack} "
                                f"| {shared / 1024:.0f} |")
    return rows


def peak_bandwidth(device: str, override_tbps: float | None) -> float | None:
    if override_tbps:
        return override_tbps * 1e12
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_HBM_BYTES_PER_S.items() if k in name), None)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the markdown report here")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: checks the script, not speed")
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--torch-max-tokens", type=int, default=65536,
                        help="skip transformers' torch reference above this many tokens (it is slow)")
    parser.add_argument("--peak-tbps", type=float, help="peak HBM bandwidth in TB/s (default: from the GPU name)")
    parser.add_argument("--block-v", type=int, nargs="+", default=[64, 32],
                        help="walk-kernel block_v values to time ours with (one row each)")
    parser.add_argument("--compile-report", action="store_true",
                        help="no GPU needed: compile the kernels for --arch and report registers / spills")
    parser.add_argument("--arch", type=int, default=90, help="compute capability for --compile-report")
    args = parser.parse_args(argv)

    if args.compile_report:
        report = "\n".join([f"# Gated delta rule kernels compiled for sm_{args.arch} (H=2, HV=8, l2norm)", "",
                            *compile_report(args.arch), ""])
        print(report)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(report)
        return 0

    if args.smoke:
        torch.set_num_threads(1)  # tiny tensors: on a busy CPU, thread synchronisation dominates
        device, dtype = "cpu", torch.float32
        heads, tokens, varlen_seqs, decode_seqs = [(2, 4, 32, 32)], [256], 4, [8]
    else:
        if not torch.cuda.is_available():
            parser.error("no CUDA GPU: run on a GPU machine, or pass --smoke for a CPU check of the script")
        device, dtype = "cuda", torch.bfloat16
        heads, tokens, varlen_seqs, decode_seqs = [(16, 32, 128, 128), (2, 8, 128, 128)], args.tokens, 64, [64, 1024]

    cases = [Case(H, HV, K, V, lengths) for H, HV, K, V in heads for T in tokens
             for lengths in ((T,), mixed_lengths(T, varlen_seqs, seed=T))]
    if not args.smoke:   # the published anchor's shape (docs/BENCHMARKS.md): Qwen3.5-0.8B's heads, 8 x 8,192 tokens
        cases.append(Case(16, 16, 128, 128, (8192,) * 8))
    decode_cases = [Case(H, HV, K, V, (1,) * N) for H, HV, K, V in heads for N in decode_seqs]
    fla_chunk, fla_recurrent, fla_name = load_fla() if device == "cuda" else (None, None, "fla-core: GPU only")
    peak = peak_bandwidth(device, args.peak_tbps)

    import triton
    peak_text = f"peak {peak / 1e12:.2f} TB/s" if peak else "peak unknown"
    where = torch.cuda.get_device_name() if device == "cuda" else f"CPU ({platform.processor() or platform.machine()})"
    title = ("SMOKE RUN on CPU: tiny shapes, float32, numbers are meaningless" if args.smoke
             else "Gated delta rule, bfloat16")
    lines = [f"# {title}", "",
             f"Device: {where}; torch {torch.__version__}, triton {triton.__version__}; {fla_name}.", "",
             "## Prefill (chunk_gated_delta_rule, l2norm in kernel, final state out)", "",
             *bench_prefill(cases, device, dtype, args.torch_max_tokens, fla_chunk,
                            args.block_v), "",
             f"TFLOP/s: {Case.flops.__doc__.split(':', 1)[1].strip()} (chunk C = {CHUNK}).",
             "GB moved: ours under our kernels' traffic model (see Case.our_bytes); peers under the minimum any "
             "implementation must move (inputs, output, final state), so their GB/s is a lower bound.",
             "Speed vs fla: fla's time / this row's time (> 1 means faster than fla).", "",
             "## Decode step (fused_recurrent_gated_delta_rule, one token per sequence)", "",
             *bench_decode(decode_cases, device, dtype, fla_recurrent, peak), "",
             f"State GB/s: fp32 state read + written once ({peak_text}).",
             ""]
    report = "\n".join(lines)
    print(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
