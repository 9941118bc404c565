"""Benchmark our gated delta rule against fla-core on the same inputs, printing each row as it is measured.

GPU (bfloat16, Qwen3.5-like shapes; fla-core installed beside, see docs/kernels/gated_delta_rule.md):
    python bench/bench_gated_delta_rule.py --out bench/out/gated_delta_rule.md [--fla-backend triton|flash_qla]
CPU smoke run (tiny shapes; proves the script runs, its numbers mean nothing):
    python bench/bench_gated_delta_rule.py --smoke
Compile report, no GPU needed (the compile matrix's delta-rule rows: registers, spills, shared memory, blocks
per SM and waves at these shapes, the walk's instructions per chunk):
    python bench/bench_gated_delta_rule.py --compile-report

Prefill: time (median of triton.testing.do_bench, after a first call that compiles, timed apart), effective
TFLOP/s and bytes under the models below, error against transformers' torch function (run once, untimed); ours
in both designs of the chunked kernels, a row each ("fused", the default, and "split"; --design picks).
Decode: one token per sequence through the recurrent kernel, bandwidth on the state bytes read and written,
against peak. fla 0.6.0 runs FlashQLA (TileLang) instead of its Triton kernels when the `flash_qla` package
imports; --fla-backend sets which one (FLA_FLASH_QLA, before fla is imported) and the report says which ran.
About a minute on an H100 with the defaults (most of it our kernels' and fla's first compiles).
"""
from __future__ import annotations

import argparse
import importlib.util
import inspect
import math
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from anywhere without installing
from triton_kernels import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule  # noqa: E402
from triton_kernels._device import target_of, use_triton  # noqa: E402

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
        n = len(self.lengths)
        kind = "single" if n == 1 else f"{n} x {self.lengths[0]}" if len(set(self.lengths)) == 1 else f"varlen x{n}"
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

    def split_bytes(self, elem: int) -> float:
        """The split design's HBM traffic (design="split"), counted as our_bytes: prep reads k, v, g, beta and
        writes w, u, gamma, k_scale; the state walk reads k, w, u, k_scale and writes each chunk's start state
        (K V per chunk) and Vn; the output kernel reads q, k, gamma, the chunk states and Vn and writes o."""
        T, HV, K, V = self.tokens, self.HV, self.K, self.V
        per_token_head = elem * (6 * K + 6 * V + 1) + elem * 2 * K * V / CHUNK + 4 * 5
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


def prefill_cases(smoke: bool, tokens: list[int] = ()) -> list[Case]:
    """The prefill shapes: issue 36's table (the published anchor's 16/16 heads x 8 x 8,192; Qwen3.5-0.8B-like
    16/32 heads at 16k tokens, one sequence and 64 mixed; 2/8 heads at 16k, one and 64), K = V = 128; plus,
    for each of `tokens`, 16/32 and 2/8 heads as one sequence and as 64 mixed ones. The compile matrix
    (tests/kernels/compile_matrix.py) compiles the same shapes."""
    if smoke:
        return [Case(2, 4, 32, 32, (256,)), Case(2, 4, 32, 32, mixed_lengths(256, 4, seed=256))]
    cases = [Case(16, 16, 128, 128, (8192,) * 8),
             Case(16, 32, 128, 128, (16384,)), Case(16, 32, 128, 128, mixed_lengths(16384, 64, seed=16384)),
             Case(2, 8, 128, 128, (16384,)), Case(2, 8, 128, 128, mixed_lengths(16384, 64, seed=16384))]
    for T in tokens:
        cases += [Case(H, HV, 128, 128, lengths) for H, HV in ((16, 32), (2, 8))
                  for lengths in ((T,), mixed_lengths(T, 64, seed=T))]
    return cases


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

_HOST_BOUNDS: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # id(cu_seqlens): (it, its host copy)


def ours(inputs, **knobs):
    """Our chunked kernels, the sequence bounds also given in host memory (as the engine passes them: the
    call then never waits for the GPU). The host copy is made once per cu_seqlens tensor, outside the timing."""
    cu = inputs.get("cu_seqlens")
    host = {}
    if cu is not None:
        if _HOST_BOUNDS.get(id(cu), (None,))[0] is not cu:
            _HOST_BOUNDS[id(cu)] = (cu, cu.cpu())
        host = {"cu_seqlens_cpu": _HOST_BOUNDS[id(cu)][1]}
    return chunk_gated_delta_rule(**inputs, **host, use_qk_l2norm_in_kernel=True, output_final_state=True, **knobs)


DESIGNS = ("fused", "split")   # the chunked kernels' designs (chunk.DESIGNS); the launch table's default first


def our_rows(case: Case, device: str, elem: int, designs, block_vs) -> list:
    """(row name, fn(inputs), bytes under its model) of each of our rows: on a GPU, every design as the launch table
    runs it and, per design, one row per fixed block_v; elsewhere one row (the torch path or the interpreter, the
    launch table's design)."""
    if device != "cuda":
        return [("ours ({where})", ours, case.our_bytes(elem))]
    rows = []
    for design in designs:
        nbytes = case.split_bytes(elem) if design == "split" else case.our_bytes(elem)
        rows.append((f"ours {design} ({walk_description(case, device)})",
                     lambda inp, d=design: ours(inp, design=d), nbytes))
        rows += [(f"ours {design} (block_v {bv} fixed)",
                  lambda inp, d=design, bv=bv: ours(inp, design=d, block_v=bv, min_block_v=bv), nbytes)
                 for bv in block_vs]
    return rows


def walk_description(case: Case, device: str, **knobs) -> str:
    """How our walk runs this case on this GPU: V block, segments (walk_layout.plan_walk)."""
    from triton_kernels.gated_delta_rule.op import chunk_knobs
    from triton_kernels.gated_delta_rule.walk_layout import plan_walk
    row = chunk_knobs(torch.device(device), **knobs)
    plan = plan_walk(list(case.lengths), case.HV, case.V, CHUNK, block_v=row.block_v, min_block_v=row.min_block_v,
                     num_sms=target_of(torch.device(device)).num_sms)
    return f"block_v {plan.block_v}" + (f", {plan.pieces} segments" if plan.pieces > 1 else "")


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


FLA_BACKENDS = {"triton": "0", "flash_qla": "1"}   # --fla-backend -> FLA_FLASH_QLA


def set_fla_backend(backend: str) -> None:
    """Choose fla's backend before fla is imported: FLA_FLASH_QLA=0 keeps its Triton kernels, 1 lets fla
    dispatch to FlashQLA when the flash_qla package imports (fla 0.6.0: backends/flash_qla.py)."""
    os.environ["FLA_FLASH_QLA"] = FLA_BACKENDS[backend]


def fla_backend_line(fla_name: str, available: bool) -> str:
    """Which fla the rows compare with, in words (the line both benchmarks print)."""
    if not available:
        return f"fla backend: none ({fla_name})"
    qla = importlib.util.find_spec("flash_qla") is not None
    flag = os.environ.get("FLA_FLASH_QLA", "unset")
    if flag != "0" and qla:
        return f"fla backend: FlashQLA (flash_qla installed, FLA_FLASH_QLA={flag}; {fla_name})"
    why = "flash_qla not installed" if not qla else "flash_qla installed but disabled"
    return f"fla backend: Triton path ({fla_name}; FLA_FLASH_QLA={flag}, {why})"


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


def first_call_s(fn, device: str) -> float:
    """Seconds of the first call (Triton compiles, fla autotunes): the warm-up, reported apart."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def time_ms(fn, device: str) -> float:
    """Median ms of fn after warm-up (its first call is first_call_s's)."""
    if device == "cuda":
        from triton.testing import do_bench
        return do_bench(fn, warmup=25, rep=100, return_mode="median")
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


class Report:
    """Markdown lines, each printed (and flushed) the moment it is known, kept for --out."""

    def __init__(self):
        self.lines: list[str] = []

    def __call__(self, *lines: str) -> None:
        for line in lines:
            self.lines.append(line)
            print(line, flush=True)


# --- the two benchmarks ---------------------------------------------------------------------------

def bench_prefill(report: Report, cases, device, dtype, torch_max_tokens, fla_chunk, block_vs, designs=DESIGNS):
    """One row per (case, implementation), printed when measured: fla first, so that each of our rows can say
    its speed against it; then ours, each design in `designs` (our_rows)."""
    reference, ref_name = load_transformers_reference()
    hf = make_transformers_fn(reference) if reference else None
    elem = torch.finfo(dtype).bits // 8
    report("| shape | implementation | first call (s) | time (ms) | TFLOP/s | GB moved (model) | GB/s "
           "| rel. RMS vs torch ref | speed vs fla |", "|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for case in cases:
        inputs = make_inputs(case, device, dtype)
        impls = []
        if fla_chunk is not None:   # fla's layout (native HV > H, or q and k repeated) chosen against our output
            fn, name = make_fla_fn(fla_chunk, inputs, ours(inputs)[0])
            impls.append((name, fn, case.min_bytes(elem)))
        where = "Triton interpreter" if use_triton(inputs["q"]) else "torch path"
        impls += [(name.format(where=where), fn, nbytes)
                  for name, fn, nbytes in our_rows(case, device, elem, designs, block_vs)]
        o_ref = None
        if hf is not None and case.tokens <= torch_max_tokens:
            o_ref = hf(inputs)[0]   # the error column's reference: run once, not timed
        fla_ms = None
        for name, fn, nbytes in impls:
            try:
                warm = first_call_s(lambda: fn(inputs), device)
                ms = time_ms(lambda: fn(inputs), device)
            except Exception as exc:  # noqa: BLE001 - a failing implementation is its row's result
                report(f"| {case.label} | {name} | failed: {type(exc).__name__}: {str(exc)[:80]} | | | | | | |")
                continue
            err = f"{rel_rms(fn(inputs)[0], o_ref):.1e}" if o_ref is not None else "-"
            fla_ms = ms if name.startswith("fla") else fla_ms
            vs_fla = f"{fla_ms / ms:.2f}x" if fla_ms and not name.startswith("fla") else "-"
            report(f"| {case.label} | {name} | {warm:.2f} | {ms:.3f} | {case.flops() / ms / 1e9:.3g} | "
                   f"{nbytes / 1e9:.3f} | {nbytes / ms / 1e6:.0f} | {err} | {vs_fla} |")
        inputs = o_ref = None   # freed before the next case is allocated
        if device == "cuda":
            torch.cuda.empty_cache()


def bench_decode(report: Report, cases, device, dtype, fla_recurrent, peak):
    report("| shape | implementation | first call (s) | time (us) | state GB/s | % of peak HBM |",
           "|---|---|---:|---:|---:|---:|")
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
                warm = first_call_s(fn, device)
                ms = time_ms(fn, device)
            except Exception as exc:  # noqa: BLE001 - a peer failing on a shape is a result, not a crash
                report(f"| {label} | {name} | failed: {type(exc).__name__} | | | |")
                continue
            gbps = state_bytes / ms / 1e6
            pct = f"{100 * gbps * 1e9 / peak:.0f}%" if peak else "-"
            report(f"| {label} | {name} | {warm:.2f} | {ms * 1e3:.1f} | {gbps:.0f} | {pct} |")


def compile_report() -> int:
    """The compile matrix's delta-rule rows (engine and bench shapes), for sm_80 and sm_90: registers,
    spills, shared memory, blocks per SM, waves, and the walk's instructions per chunk. No GPU needed."""
    from tests.kernels import compile_matrix
    return compile_matrix.main(["--only", "delta"])


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
    parser.add_argument("--tokens", type=int, nargs="*", default=[],
                        help="extra prefill sizes: 16/32 and 2/8 heads, one sequence and 64, at each token count")
    parser.add_argument("--torch-max-tokens", type=int, default=16384,
                        help="transformers' torch reference (the error column, run once) up to this many tokens")
    parser.add_argument("--peak-tbps", type=float, help="peak HBM bandwidth in TB/s (default: from the GPU name)")
    parser.add_argument("--block-v", type=int, nargs="*", default=[],
                        help="also time ours with the walk's block_v fixed at each of these (one row each)")
    parser.add_argument("--design", choices=DESIGNS, nargs="+", default=list(DESIGNS),
                        help="our chunked kernels' designs to time, one row each (default: both; on a GPU only)")
    parser.add_argument("--fla-backend", choices=sorted(FLA_BACKENDS), default="triton",
                        help="fla-core's implementation to compare with: its Triton kernels (default) or FlashQLA")
    parser.add_argument("--compile-report", action="store_true",
                        help="no GPU needed: the compile matrix's delta-rule rows (sm_80 and sm_90)")
    args = parser.parse_args(argv)

    if args.compile_report:
        return compile_report()

    if args.smoke:
        torch.set_num_threads(1)  # tiny tensors: on a busy CPU, thread synchronisation dominates
        device, dtype = "cpu", torch.float32
        heads, decode_seqs = [(2, 4, 32, 32)], [8]
    else:
        if not torch.cuda.is_available():
            parser.error("no CUDA GPU: run on a GPU machine, or pass --smoke for a CPU check of the script")
        device, dtype = "cuda", torch.bfloat16
        heads, decode_seqs = [(16, 32, 128, 128), (2, 8, 128, 128)], [64, 1024]
    set_fla_backend(args.fla_backend)
    cases = prefill_cases(args.smoke, args.tokens)
    decode_cases = [Case(H, HV, K, V, (1,) * N) for H, HV, K, V in heads for N in decode_seqs]
    fla_chunk, fla_recurrent, fla_name = load_fla() if device == "cuda" else (None, None, "GPU only")
    peak = peak_bandwidth(device, args.peak_tbps)

    import triton
    report = Report()
    peak_text = f"peak {peak / 1e12:.2f} TB/s" if peak else "peak unknown"
    where = torch.cuda.get_device_name() if device == "cuda" else f"CPU ({platform.processor() or platform.machine()})"
    title = "SMOKE RUN on CPU: tiny shapes, float32, numbers are meaningless" if args.smoke else "Gated delta rule, bf16"
    report(f"# {title}", "", f"Device: {where}; torch {torch.__version__}, triton {triton.__version__}.",
           fla_backend_line(fla_name, fla_chunk is not None) + ".", "",
           "## Prefill (chunk_gated_delta_rule, l2norm in kernel, final state out)", "")
    bench_prefill(report, cases, device, dtype, args.torch_max_tokens, fla_chunk, args.block_v, args.design)
    report("", f"TFLOP/s: {Case.flops.__doc__.split(':', 1)[1].strip()} (chunk C = {CHUNK}).",
           "GB moved: ours under our kernels' traffic model (Case.our_bytes, the split design Case.split_bytes); "
           "peers under the minimum any "
           "implementation must move (inputs, output, final state), so their GB/s is a lower bound.",
           "First call: seconds of the first call (compiles, autotuning), not in the time column. "
           "Speed vs fla: fla's time / this row's time (> 1: faster than fla).", "",
           "## Decode step (fused_recurrent_gated_delta_rule, one token per sequence)", "")
    bench_decode(report, decode_cases, device, dtype, fla_recurrent, peak)
    report("", f"State GB/s: fp32 state read + written once ({peak_text}).", "")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(report.lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
