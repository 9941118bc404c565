"""Step esm_step: one ~32k-token step of make_fasta-length sequences through the native engine (ESM-2 650M shape,
random bf16 weights made on the GPU): ms per step and tok/s from CUDA events (after warm-ups, which compile the
Triton kernels), then torch.profiler's kernels of one step (top 30) and the GPU-busy fraction. The same sequences
through transformers' EsmModel (SDPA) in length-sorted padded batches of the same token budget, the way the hf
engine batches them, so the ratio of the two is visible."""
from __future__ import annotations

import numpy as np
import torch

from .models import esm_tokenizer, hf_model, native_engine, step_texts
from .report import Report
from .setting import Setting
from .timing import kernel_table, median, profile, time_ms


def busy(setting: Setting) -> str:
    """What kernel time over wall time is: the GPU's busy fraction, or (--smoke) CPU op time, threads summed."""
    return "GPU busy" if setting.gpu else "CPU op time / wall"


def native(setting: Setting, report: Report, ids: list[list[int]]) -> float:
    engine = native_engine(setting, esm_tokenizer(setting.scratch / "esm_tokenizer"))
    final, tokens = engine.info.num_layers, sum(map(len, ids))
    steps_before = engine.stats.steps
    forward = lambda: engine.forward(ids, [final], False)   # noqa: E731
    times = time_ms(forward, setting)
    steps = (engine.stats.steps - steps_before) // (setting.warmups + setting.repeats)
    step_ms = median(times)
    # The model alone on a prepared step: what the engine's scheduling, prepare and output copy add is the rest.
    from pipeline.engine.sequence import Sequence
    scheduler = engine._scheduler()
    for i, seq in enumerate(ids):
        scheduler.add(Sequence(i, list(seq)))
    ctx = engine.runner.prepare(scheduler.schedule(), scheduler.blocks)
    model_ms = median(time_ms(lambda: engine.runner.run(ctx, frozenset()), setting))
    t = report.table("native engine", "steps", "tokens", "ms (median)", "min", "max", "tok/s")
    t.row("NativeEngine.forward (schedule, prepare, run, output copy)", steps, tokens, step_ms, min(times), max(times),
          tokens / step_ms * 1e3)
    t.row("ModelRunner.run on a prepared step", 1, tokens, model_ms, float("nan"), float("nan"), tokens / model_ms * 1e3)
    variants = _variants(engine, ctx, setting, tokens, t)
    kernels, busy_ms, wall_ms = profile(forward, setting)
    kernel_table(report, setting, kernels, step_ms)
    report.line(f"kernel time {busy_ms:.1f} ms in a profiled step of {wall_ms:.1f} ms wall: {busy(setting)} "
                f"{busy_ms / wall_ms:.0%} "
                f"(of the unprofiled {step_ms:.1f} ms step: {busy_ms / step_ms:.0%})")
    for key, value in (("step_ms", step_ms), ("model_ms", model_ms), ("variants_ms", variants), ("tokens", tokens), ("steps", steps),
                       ("tok_per_s", tokens / step_ms * 1e3), ("kernel_ms", busy_ms), ("busy_fraction", busy_ms / step_ms),
                       ("top_kernels", [(k.name[:120], k.count, round(k.ms, 3)) for k in kernels[:30]])):
        report.keep(key, value)
    report.headline(f"native: {step_ms:.1f} ms per {tokens:,}-token step = {tokens / step_ms * 1e3:,.0f} tok/s "
                    f"(model alone {model_ms:.1f} ms); {busy(setting)} {busy_ms / step_ms:.0%}")
    del engine, ctx
    return step_ms


def _variants(engine, ctx, setting: Setting, tokens: int, t) -> dict:
    """ModelRunner.run on the same prepared step with parts of the fusion turned off: the unfused layers (before
    issue 35's kernels), and the fused layers with cuBLAS + a GELU pass instead of linear_gelu (the launch table's
    epilogue_gelu choice)."""
    from dataclasses import replace

    import pipeline.models.esm as esm
    out = {}
    model, knobs = engine.model, esm.gemm_knobs
    for label, fused, gelu in (("unfused layers (rotary x14, KV write, separate adds, norms, GELU)", False, None),
                               ("fused, GELU as cuBLAS + a GELU pass", True, False),
                               ("fused, GELU in linear_gelu's epilogue", True, True)):
        if setting.seconds_left() < 20:
            t.row(f"{label}: left out ({setting.seconds_left():.0f} s left)", "", "", "", "", "", "")
            continue
        model.fuse_elementwise = fused
        esm.gemm_knobs = knobs if gelu is None else (lambda device, g=gelu, **k: replace(knobs(device, **k),
                                                                                            epilogue_gelu=g))
        try:
            ms = median(time_ms(lambda: engine.runner.run(ctx, frozenset()), setting))
        finally:
            model.fuse_elementwise, esm.gemm_knobs = True, knobs
        out[label] = ms
        t.row(f"ModelRunner.run, {label}", 1, tokens, ms, float("nan"), float("nan"), tokens / ms * 1e3)
    return out


def transformers_padded(setting: Setting, report: Report, ids: list[list[int]], native_ms: float) -> None:
    from pipeline.worker.batching import plan_batches
    model = hf_model(setting)
    order = sorted(ids, key=len, reverse=True)
    lengths = np.array([len(x) for x in order])
    batches = []
    for a, b in plan_batches(lengths, setting.step_tokens, 256, padded=True):
        width = int(lengths[a])
        input_ids = torch.full((b - a, width), 1, dtype=torch.int64)   # <pad> is 1 in ESM's vocabulary
        for i, seq in enumerate(order[a:b]):
            input_ids[i, :len(seq)] = torch.tensor(seq)
        batches.append((input_ids.to(setting.device), (input_ids != 1).long().to(setting.device)))

    @torch.inference_mode()
    def forward():
        for input_ids, mask in batches:
            model(input_ids=input_ids, attention_mask=mask).last_hidden_state

    tokens = int(lengths.sum())
    padded = sum(int(x.numel()) for x, _ in batches)
    times = time_ms(forward, setting)
    ms = median(times)
    per_32k = ms * 32768 / tokens
    t = report.table("transformers EsmModel (SDPA, padded)", "batches", "tokens (padded)", "ms (median)",
                     "ms per 32k tokens", "tok/s", "native's speed-up")
    t.row(f"{len(batches)} length-sorted padded batches", len(batches), f"{tokens:,} ({padded:,})", ms, per_32k,
          tokens / ms * 1e3, f"{ms / native_ms:.2f}x")
    for key, value in (("hf_ms", ms), ("hf_ms_per_32k", per_32k), ("hf_padded_tokens", padded),
                       ("native_speedup_vs_hf", ms / native_ms)):
        report.keep(key, value)
    report.headline(f"transformers (SDPA, padded): {ms:.1f} ms for the same tokens ({per_32k:.1f} ms per 32k); "
                    f"native is {ms / native_ms:.2f}x")
    if setting.seconds_left() < 15:
        report.line(f"transformers' kernel table left out: {setting.seconds_left():.0f} s left of the step's limit")
        return
    kernels, busy_ms, wall_ms = profile(forward, setting)
    kernel_table(report, setting, kernels, ms)
    report.line(f"kernel time {busy_ms:.1f} ms in a profiled pass of {wall_ms:.1f} ms wall: {busy(setting)} "
                f"{busy_ms / wall_ms:.0%}")
    report.keep("hf_busy_fraction", busy_ms / ms)
    report.keep("hf_top_kernels", [(k.name[:120], k.count, round(k.ms, 3)) for k in kernels[:30]])


def run(setting: Setting, report: Report) -> None:
    tokenizer = esm_tokenizer(setting.scratch / "esm_tokenizer")
    texts = step_texts(setting)
    ids = tokenizer(texts)["input_ids"]
    report.line(f"{len(ids)} make_fasta.py sequences (seed 1), {sum(map(len, ids)):,} tokens; "
                f"{setting.warmups} warm-ups, {setting.repeats} timed repeats (CUDA events)")
    native_ms = native(setting, report, ids)
    if setting.gpu:
        torch.cuda.empty_cache()
    transformers_padded(setting, report, ids, native_ms)
