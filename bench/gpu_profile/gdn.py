"""Step gdn: the gated delta rule prefill, ours (triton_kernels/gated_delta_rule) beside fla-core's
chunk_gated_delta_rule on its Triton path (FLA_FLASH_QLA=0 is set before fla is imported, so that a FlashQLA
install does not stand in for it; the kernel names in the table show what ran), at bench_gated_delta_rule.py's
shapes, bf16, K = V = 128: total ms (triton's do_bench median), ours in both designs of the chunked kernels
(the launch table's default "fused" as "ours", and "ours split", issue 36's rewrite, on a GPU), then each
kernel's ms per call from torch.profiler, then one launch-knob variant each of ours (prep_num_warps 4, block_v
32, num_stages 1). The
three tables print in that order, so the totals come first if the step runs out of time (variants compile anew)."""
from __future__ import annotations

import os

os.environ.setdefault("FLA_FLASH_QLA", "0")   # before fla is imported anywhere in this process

import importlib.util  # noqa: E402

import torch  # noqa: E402

from .report import Report  # noqa: E402
from .setting import Setting  # noqa: E402
from .timing import bench_ms, profile, short  # noqa: E402

VARIANTS = {"prep_num_warps=4": dict(prep_num_warps=4), "block_v=32": dict(block_v=32, min_block_v=32),  # fixed
            "num_stages=1": dict(num_stages=1)}
PROFILED_RUNS = 5   # calls per profile on the GPU (1 in --smoke)


def cases(setting: Setting) -> list:
    from bench_gated_delta_rule import Case, mixed_lengths
    if setting.smoke:
        return [Case(2, 4, 16, 16, (128,)), Case(2, 4, 16, 16, mixed_lengths(128, 4, seed=128))]
    return [Case(16, 16, 128, 128, (8192,) * 8), Case(16, 32, 128, 128, (16384,)),
            Case(16, 32, 128, 128, mixed_lengths(16384, 64, seed=16384)),
            Case(2, 8, 128, 128, mixed_lengths(16384, 64, seed=16384))]


def fla_backend(setting: Setting) -> tuple[object, str]:
    """(fla's chunk_gated_delta_rule or None, which backend it runs, in words)."""
    if not setting.gpu:
        return None, "fla-core rows: GPU only (its Triton kernels take CUDA tensors)"
    from bench_gated_delta_rule import load_fla
    fla_chunk, _, name = load_fla()
    if fla_chunk is None:
        return None, f"no fla rows: {name}"
    qla = importlib.util.find_spec("flash_qla") is not None
    return fla_chunk, (f"{name}, Triton path (FLA_FLASH_QLA={os.environ['FLA_FLASH_QLA']}; flash_qla "
                       f"{'installed but disabled' if qla else 'not installed'})")


def timed(impls: dict, setting: Setting) -> tuple[dict[str, float], dict[str, str]]:
    """(ms of each implementation that ran, what each one that raised said): a failure is its row's result, not the
    step's end (fla-core's kernels and our split design run on a GPU only, first tried in a lent GPU's minutes)."""
    times, failed = {}, {}
    for name, fn in impls.items():
        try:
            times[name] = bench_ms(fn, setting)
        except Exception as e:  # noqa: BLE001 - any failure is reported in the row, the other rows go on
            failed[name] = f"failed: {type(e).__name__}: {str(e)[:100]}"
    return times, failed


def label(case) -> str:
    n = len(case.lengths)
    return f"H{case.H}/HV{case.HV}, {case.tokens:,} tokens in {n} seq{'s' if n > 1 else ''}"


def run(setting: Setting, report: Report) -> None:
    from bench_gated_delta_rule import make_fla_fn, make_inputs, ours
    fla_chunk, backend = fla_backend(setting)
    report.line(f"{'bf16' if setting.gpu else 'float32 (--smoke: the torch path)'}, K = V = 128 (toy sizes in --smoke); "
                f"{backend}")
    prepared = []
    totals = report.table("shape", "implementation", "ms (median)", "vs fla")
    for case in cases(setting):
        inputs = make_inputs(case, str(setting.device), setting.dtype)
        impls = {"ours": lambda inp=inputs: ours(inp)}
        if setting.gpu:   # on the CPU both designs are the torch path
            impls["ours split"] = lambda inp=inputs: ours(inp, design="split")
        if fla_chunk is not None:
            fn, name = make_fla_fn(fla_chunk, inputs, ours(inputs)[0])
            impls[name] = lambda inp=inputs, fn=fn: fn(inp)
        times, failed = timed(impls, setting)
        fla_ms = next((ms for name, ms in times.items() if name.startswith("fla")), None)
        for name in impls:
            if name in failed:
                totals.row(label(case), name, failed[name], "")
                continue
            ms = times[name]
            totals.row(label(case), name, ms, f"{fla_ms / ms:.2f}x" if fla_ms and name.startswith("ours") else "")
            report.keep(f"{label(case)} / {name}", ms)
        ours_ms = times.get("ours")
        report.headline(f"delta rule {label(case)}: ours "
                        + (f"{ours_ms:.3f} ms" if ours_ms else "failed")
                        + (f", split {times['ours split']:.3f} ms" if "ours split" in times else "")
                        + (f", fla {fla_ms:.3f} ms" if fla_ms else "")
                        + (f" ({fla_ms / ours_ms:.2f}x)" if fla_ms and ours_ms else "")
                        + (f"; failed: {', '.join(failed)}" if failed else ""))
        prepared.append((case, inputs, {name: fn for name, fn in impls.items() if name not in failed}))

    if setting.seconds_left() < 20:
        report.line(f"per-kernel times and knob variants left out: {setting.seconds_left():.0f} s left of the step's limit")
        return
    per_kernel = report.table("shape", "implementation", "kernel", "calls per run", "ms per run")
    runs = PROFILED_RUNS if setting.gpu else 1
    for case, inputs, impls in prepared:
        for name, fn in impls.items():
            kernels, busy, _ = profile(fn, setting, runs)
            for k in kernels[:8]:
                per_kernel.row(label(case), name, short(k.name, 70), k.count / runs, k.ms / runs)
            report.keep(f"{label(case)} / {name} / kernels", [(k.name[:100], k.ms / runs) for k in kernels[:8]])

    if not setting.gpu:
        report.line("launch-knob variants: GPU only (the torch path has no knobs)")
        return
    variants = report.table("shape", "ours with", "ms (median)", "vs ours default")
    for case, inputs, impls in prepared:
        if setting.seconds_left() < 15:   # each variant compiles anew
            report.line(f"variants of the remaining shapes left out: {setting.seconds_left():.0f} s left")
            break
        if "ours" not in impls:   # it failed above: no base to compare with
            continue
        base = bench_ms(lambda: ours(inputs), setting)
        for name, knobs in VARIANTS.items():
            try:
                ms = bench_ms(lambda: ours(inputs, **knobs), setting)
            except Exception as e:  # noqa: BLE001 - a variant that does not compile is its row's result
                variants.row(label(case), name, f"failed: {type(e).__name__}: {str(e)[:100]}", "")
                continue
            variants.row(label(case), name, ms, f"{base / ms:.2f}x")
            report.keep(f"{label(case)} / ours {name}", ms)
        del inputs
        torch.cuda.empty_cache()
