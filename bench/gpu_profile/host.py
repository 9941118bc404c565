"""Step host: what the host does per step on the GPU machine's CPU, while (today) the GPU waits: tokenization
(SequenceTokenizer.encode with transformers' ESM tokenizer, built offline) in us per residue,
ModelRunner.prepare and EmbedTask.compute in ms; then every host-device synchronisation inside one
NativeEngine.forward + EmbedTask.compute (torch.cuda.set_sync_debug_mode("warn")), each with the first frame
of the project's code that caused it. On CPU (--smoke) the audit is a dispatch mode that flags the ops that
would synchronise on a GPU (copies to the host are invisible there)."""
from __future__ import annotations

import collections
import time
import traceback
import warnings
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import REPO
from .models import esm_tokenizer, native_engine, step_texts
from .report import Report
from .setting import Setting

SYNCING_OPS = {"_local_scalar_dense", "item", "nonzero", "unique", "_unique2", "unique_dim", "unique_consecutive",
               "bincount", "masked_select", "repeat_interleave", "argwhere"}


def host_ms(fn, setting: Setting, repeats: int = 5) -> float:
    """Best host milliseconds of fn (the host clock around the call alone; the device drained between calls)."""
    best = float("inf")
    for _ in range(repeats):
        setting.sync()
        start = time.perf_counter()
        fn()
        best = min(best, (time.perf_counter() - start) * 1e3)
    setting.sync()
    return best


def project_frame(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frame of the project's own code (pipeline/, triton_kernels/, index/), as file:line (function)."""
    for frame in reversed(stack):
        path = Path(frame.filename)
        try:
            relative = path.resolve().relative_to(REPO)
        except ValueError:
            continue
        if relative.parts[0] in ("pipeline", "triton_kernels", "index"):
            return f"{relative}:{frame.lineno} ({frame.name})"
    return "outside the project"


class SyncOps(TorchDispatchMode):
    """CPU stand-in for the sync audit: the ops that make a GPU wait for its results."""

    def __init__(self):
        super().__init__()
        self.sites: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        bool_index = name in ("index", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else []) or [])
        # repeats given as a tensor: the output's size is read from the device
        tensor_repeats = name == "repeat_interleave" and func._overloadname in ("Tensor", "self_Tensor")
        if name in SYNCING_OPS - {"repeat_interleave"} or bool_index or tensor_repeats:
            self.sites.append((name, project_frame(traceback.extract_stack()[:-1])))
        return func(*args, **(kwargs or {}))


def sync_audit(setting: Setting, work) -> list[tuple[str, str]]:
    """(what, where) of each synchronisation while `work()` runs."""
    if not setting.gpu:
        mode = SyncOps()
        with mode:
            work()
        return mode.sites
    sites = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            sites.append((str(message).split(".")[0][:60], project_frame(traceback.extract_stack()[:-1])))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            work()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # Drained after the audit: inside it this explicit wait would warn too (Stream.synchronize goes through
    # c10::cuda::stream_synchronize) and count as one more sync, "outside the project". Event.synchronize (the
    # batch's HostCopy.wait) does not warn in this mode, so the table leaves that one wait out.
    torch.cuda.current_stream().synchronize()
    return sites


def run(setting: Setting, report: Report) -> None:
    from pipeline.config import RunConfig
    from pipeline.engine.sequence import Sequence
    from pipeline.tasks import make_task
    from pipeline.tasks.tokenization import SequenceTokenizer

    hf_tokenizer = esm_tokenizer(setting.scratch / "esm_tokenizer")
    texts = step_texts(setting)
    residues = sum(map(len, texts))
    tokenizer = SequenceTokenizer(hf_tokenizer, max_tokens=1024)
    encode_ms = host_ms(lambda: tokenizer.encode(texts), setting, 3)
    toks = tokenizer.encode(texts)
    ids = [t.ids for t in toks]
    engine = native_engine(setting, hf_tokenizer)
    final = engine.info.num_layers
    scheduler = engine._scheduler()
    for i, seq in enumerate(ids):
        scheduler.add(Sequence(i, list(seq)))
    step = scheduler.schedule()
    prepare_ms = host_ms(lambda: engine.runner.prepare(step, scheduler.blocks), setting)
    task = make_task(RunConfig(fasta=["x"], task="embed"), engine.info)
    out = engine.forward(ids, [final], False)
    compute_ms = host_ms(lambda: task.compute(out, toks), setting)
    engine.forward(ids, [final], False)   # warm (Triton compiled, caches allocated) before the audit
    t = report.table("host work per step", "ms", "per residue", "note")
    t.row(f"SequenceTokenizer.encode ({type(hf_tokenizer).__name__})", encode_ms, f"{encode_ms * 1e3 / residues:.2f} us",
          f"{len(texts)} sequences, {residues:,} residues")
    t.row("ModelRunner.prepare", prepare_ms, "", f"{len(step)} sequences, host arrays + copies to the device")
    t.row("EmbedTask.compute (mean pooling, copy to host)", compute_ms, "", "device time included (it ends in a copy)")
    for key, value in (("encode_ms", encode_ms), ("encode_us_per_residue", encode_ms * 1e3 / residues),
                       ("prepare_ms", prepare_ms), ("embed_compute_ms", compute_ms)):
        report.keep(key, value)

    sites = sync_audit(setting, lambda: task.compute(engine.forward(ids, [final], False), toks))
    counts = collections.Counter(sites)
    audit = "torch.cuda.set_sync_debug_mode('warn')" if setting.gpu else "CPU dispatch audit (ops that sync on a GPU)"
    t = report.table(f"synchronisation ({audit})", "where (first project frame)", "count")
    for (what, where), n in counts.most_common():
        t.row(what, where, n)
    if setting.gpu:
        report.line("(a CUDA event's wait, HostCopy.wait: the batch's one planned wait for its results, does not warn "
                    "in this mode and is not in the table)")
    report.keep("syncs", [[w, s, n] for (w, s), n in counts.most_common()])
    report.headline(f"host: tokenizer {encode_ms * 1e3 / residues:.2f} us/residue ({encode_ms:.1f} ms per step), prepare "
                    f"{prepare_ms:.1f} ms, embed compute {compute_ms:.1f} ms; {len(sites)} syncs in one forward + compute")
