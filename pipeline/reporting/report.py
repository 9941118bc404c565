"""OUT/report.html: one self-contained page about a run, finished, partial or failed (charts as inline SVG,
drawn by svg_charts.py; no script, no style sheet or font from elsewhere, nothing fetched).

Every `run`, `rerun` and `merge` writes it at its end, and `run_shards report OUT` writes it again; the
facts come from the run directory (facts.py), so a SLURM or Ray run gets the same page, and a SLURM run a
section on its jobs (ids, nodes, queue waits, requeues and why, the merge job).
"""
from __future__ import annotations

import datetime
import html
import json
from itertools import cycle
from pathlib import Path

import numpy as np

from ..advice import MANY_FILES, command, files_shown
from ..output import copy_plan, status_codes
from ..config import LISTED_SHARDS
from ..errors import UserError
from ..rundir.layout import RunDir, write_atomic
from .facts import Attempt, RunFacts, gather
from .svg_charts import CYCLE, Axis, Chart, Panel, limits

GANTT_SHARDS = 48          # rows of the time chart at most
PHASES = ("prepare", "start workers and load model", "compute", "finish shards and merge")
COLORS = {"load": "#ccb974", "compute": "#4c72b0", "finish": "#64b5cd", "prepare": "#8172b3"}


def write(out: str | Path, error: str | None = None) -> Path:
    """Write OUT/report.html (atomically) from the run directory; its path. `error`: what ended the command
    that writes it (by default, the last failure report in run.log)."""
    run = RunDir(str(out))
    page = render(gather(run, error))
    path = run.root / "report.html"
    try:
        write_atomic(path, page)
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror or e}") from None
    return path


def lengths_chart(f: RunFacts) -> str:
    """Residues per record on a log scale, so the token budget and the model's limit are always in view."""
    lengths = f.lengths[f.lengths > 0]
    limit = f.manifest.get("max_tokens")
    top = max([int(lengths.max()) if len(lengths) else 1, f.budget or 1, limit or 1])
    edges = np.geomspace(1, top * 1.2, 60)
    counts = np.histogram(lengths, bins=edges)[0]
    panel = Panel(Axis(1.0, top * 1.2, log=True), limits(counts, integer=True),
                  xlabel="residues per record (log scale; tokens add the model's special tokens)", ylabel="records")
    panel.histogram(edges, counts, "#4c72b0", label=f"{len(f.lengths):,} records")
    if f.budget:
        panel.vline(f.budget, "#dd8452", dash="--", label=f"token budget per batch ({f.budget:,})")
    if limit:
        panel.vline(limit, "#c44e52", label=f"model's limit ({limit:,} tokens)")
    return Chart([panel], 600, 170).svg("histogram of sequence lengths")


def balance_chart(f: RunFacts) -> str:
    ranks = [s.rank for s in f.shards]
    values = {"sequences": [s.expected for s in f.shards], "residues": [s.residues for s in f.shards],
              "tokens (durable rows)": [s.tokens for s in f.shards],
              "worker seconds": [_worker_seconds(s.attempts) for s in f.shards]}
    x = Axis(min(ranks, default=0) - 0.6, max(ranks, default=0) + 0.6, integer=True,
             step=1.0 if len(ranks) <= 16 else 0.0)
    panels = []
    for label, ys in values.items():
        panel = Panel(x, limits(ys, integer=label != "worker seconds"), title=label, xlabel="shard")
        panel.bars(ranks, ys, "#55a868")
        panels.append(panel)
    return Chart(panels, 960, 140, legend=False).svg("sequences, residues, tokens and seconds per shard")


def _worker_seconds(attempts: list[Attempt]) -> float:
    return sum(a.end - a.start for a in attempts)


def throughput_chart(f: RunFacts) -> str:
    """Each worker's tokens per second between checkpoints, and its durable rows, since it started."""
    legend = len(f.shards) <= 12
    series = []    # (label, dotted, step xs, rates, row xs, durable rows)
    for s in f.shards:
        for number, a in enumerate(s.attempts, 1):
            label = f"shard {s.rank}" + (f", attempt {number}" if len(s.attempts) > 1 else "")
            previous = a.loaded or a.start
            xs, rates, durable = [], [], []
            for t, n, tokens in a.checkpoints:
                xs.append(t - a.start)
                rates.append((tokens if tokens is not None else n) / max(t - previous, 1e-3))
                durable.append(n + (durable[-1] if durable else 0))
                previous = t
            if xs:
                loaded = (a.loaded or a.start) - a.start
                series.append((label, number < len(s.attempts), [loaded] + xs, [rates[0]] + rates, [0.0] + xs,
                               [0] + durable))
    no_tokens = any(tokens is None for s in f.shards for a in s.attempts for *_, tokens in a.checkpoints)
    seconds = Axis(0.0, max([x for *_, xs, _ in series for x in xs] + [0.0]) * 1.05 or 1.0)
    speed = Panel(seconds, limits([r for _, _, _, rates, *_ in series for r in rates]),
                  title="throughput between checkpoints", xlabel="seconds since the worker started",
                  ylabel="rows per second" if no_tokens else "tokens per second")
    rows = Panel(seconds, limits([n for *_, durable in series for n in durable], integer=True), title="progress",
                 xlabel="seconds since the worker started", ylabel="rows made durable by this attempt")
    for (label, earlier, step_xs, rates, xs, durable), color in zip(series, cycle(CYCLE)):
        style = dict(label=label if legend else "", dash=":" if earlier else "-", width=1.5 if legend else 0.7)
        speed.step(step_xs, rates, color, **style)
        rows.line(xs, durable, color, marker=True, **style)
    if not series:
        speed.note = rows.note = "no checkpoint yet"
    return Chart([speed, rows], 960, 180, legend=legend).svg("each worker's throughput and progress over time")


def time_chart(f: RunFacts) -> str:
    return time_figure(f).svg("time split of the run and of each shard")


def time_figure(f: RunFacts) -> Chart:
    """The run's time split (its last local run's) above each shard's latest attempt: start and load, compute,
    finish. With the split, shards are placed on the run's own clock, and those that ran in an earlier
    command (before a `rerun`) are left out. The legend sits above the chart, clear of the axis label."""
    latest = [(s.rank, s.attempts[-1]) for s in f.shards if s.attempts]
    origin = min((a.start for _, a in latest), default=0.0)
    if f.timings and f.timings_end:
        origin = f.timings_end - sum(f.timings)
        latest = [(r, a) for r, a in latest if origin - 1 <= a.start <= f.timings_end]
    if len(latest) > GANTT_SHARDS:   # the stragglers are the ones to see
        latest = sorted(sorted(latest, key=lambda x: -x[1].end)[:GANTT_SHARDS])
    bars, labels = [], []   # (row, left, length, colour key, legend label)
    if f.timings:
        left = 0.0
        for name, value, key in zip(PHASES, f.timings, ("prepare", "load", "compute", "finish")):
            bars.append((0, left, value, key, f"run: {name}"))
            left += value
        labels.append("whole run")
    for rank, a in latest:
        end_compute = a.checkpoints[-1][0] if a.checkpoints else a.end
        pieces = [("start and load", a.start, a.loaded or a.end, "load"),
                  ("compute", a.loaded, end_compute if a.loaded else None, "compute"),
                  ("finish shard", end_compute, a.completed, "finish")]
        for name, t0, t1, key in pieces:
            if t0 is not None and t1 is not None and t1 >= t0:
                bars.append((len(labels), t0 - origin, t1 - t0, key, f"shard: {name}"))
        labels.append(f"shard {rank}")
    right = max([left + length for _, left, length, *_ in bars] + [0.0])
    panel = Panel(Axis(min([0.0] + [left for _, left, *_ in bars]), right * 1.05 or 1.0),
                  Axis(-0.6, len(labels) - 0.4, names=tuple(labels)),
                  xlabel=(("seconds since the last command started" if _continued(f) else "seconds since the run "
                           "started") if f.timings else "seconds since the first worker started")
                  + (f"; the {GANTT_SHARDS} shards that finished last" if len(latest) == GANTT_SHARDS else ""))
    for row, left, length, key, label in bars:
        panel.hbar(row, left, length, COLORS[key], label=label, edge="white" if label.startswith("shard") else "")
    if not labels:
        panel.note = "no worker has started yet"
    return Chart([panel], 720, 22.4 * max(len(labels), 1) + 8)


def _when(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).isoformat(sep=" ", timespec="seconds")


def _headline(f: RunFacts) -> str:
    done = sum(s.state == "complete" for s in f.shards)
    total = int(f.manifest["index"]["count"])
    variants = f" and {sum(f.variant_statuses.values()):,} variants" if f.task.startswith("variants") else ""
    if f.result == "complete":
        return (f"<p id='headline' class='complete'>finished: {html.escape(str(f.root))}/result.h5 holds {f.rows:,} "
                f"rows{variants}</p>")
    if f.result == "partial":
        return (f"<p id='headline' class='failed'>PARTIAL result: {html.escape(str(f.root))}/result.h5 holds "
                f"{f.rows:,} of {total:,} "
                f"rows{variants} (`{html.escape(command('rerun', f.root))}` computes the rest)</p>")
    running = sum(s.state == "running" for s in f.shards)
    return (f"<p id='headline' class='{'running' if running else 'failed'}'>"
            + (f"running now ({running} shard(s) being computed): " if running else "not finished: ")
            + f"{done} of {len(f.shards)} shard(s) complete, {f.rows:,} of {total:,} rows durable; no result.h5 "
            "yet</p>")


def _next_step(f: RunFacts) -> str:
    """The one command that moves an unfinished run on (or where to follow it)."""
    if f.result == "complete":
        return ""
    root = f.root
    queued = f.slurm is not None and (f.slurm.merge_state.split(" ")[0] in ("PENDING", "RUNNING", "REQUEUED")
                                      or bool(f.slurm.by_hand))
    if queued or any(s.state == "running" for s in f.shards):
        text = f"shards are being computed or queued now: follow them with `{command('status', root)}`"
    elif all(s.state == "complete" for s in f.shards):
        text = f"every shard is complete: `{command('merge', root)}` writes the result"
    elif all(s.failure is not None and s.failure.rerun_repeats for s in f.shards if s.state != "complete"):
        text = ("a rerun stops the same way: the unfinished shards refused the run's settings, and their recorded "
                "failure says which to change")
    else:
        text = f"`{command('rerun', root)}` computes the unfinished shards (from their checkpoints) and merges"
    return f"<p id='next'>Next: {html.escape(text)}</p>"


def _continued(f: RunFacts) -> bool:
    """Whether shards were computed before the command whose time split is recorded (a run continued by a
    `rerun` or the same `run` again): that split is then the last command's, not the whole run's."""
    if not (f.timings and f.timings_end):
        return False
    origin = f.timings_end - sum(f.timings)
    return any(a.start < origin - 1 for s in f.shards for a in s.attempts)


def _timings(f: RunFacts) -> str:
    if f.timings:
        split = ", ".join(f"{n} {v:.1f} s" for n, v in zip(PHASES, f.timings))
        if _continued(f):
            split += ("; of the last command only, which continued the run (the attempts before it: "
                      "Failures and restarts)")
        return f'<p id="timings">{split}</p>'
    if f.slurm is not None:
        return ("<p id='timings'>a SLURM run: its tasks ran on the cluster's nodes (below: each shard's latest "
                "attempt, and the jobs' queue waits in the SLURM section)</p>")
    return ("<p id='timings'>no time split recorded: the run has not merged here yet (a Ray run, or one that "
            "stopped); below, each shard's latest attempt</p>")


def _seconds(t: float | None) -> str:
    return "" if t is None else f"{t:,.0f} s"


def _slurm_section(f: RunFacts) -> str:
    """A SLURM run's jobs: each submission with its merge job and how that ended, and per shard its task(s),
    node(s), queue wait and requeues with their causes."""
    if f.slurm is None:
        return ""
    e, sl = html.escape, f.slurm
    hand = f"<p id='slurm_by_hand'>{e(' '.join(sl.by_hand))}</p>" if sl.by_hand else ""
    if not sl.submissions:
        return "<h2>SLURM</h2>" + (hand or "<p id='slurm'>nothing submitted (a --dry-run, or sbatch refused: see "
                                           "above)</p>")
    merged = {m["slurm_job"]: m for m in sl.merges}
    subs = []
    for k, sub in enumerate(sl.submissions):
        mid = sub["merge_job_id"]
        end = merged.get(mid)
        state = (("merged in " + _seconds(end.get("seconds"))) if not end.get("error") else
                 "FAILED: " + end["error"].splitlines()[0]) if end else \
            (sl.merge_state or "not known to squeue now") if k == len(sl.submissions) - 1 else "replaced or ended"
        arrays = ", ".join(f"{a['job_id']} [{a['array']}]" for a in sub["arrays"]) or "none"
        subs.append(f"<tr><td>{e(sub['submitted'])}</td><td>{e(arrays)}</td><td>{e(mid)}</td><td>{e(state)}</td></tr>")
    rows = []
    for s in f.shards:
        task = sl.tasks.get(s.rank)
        runs = [a for a in s.attempts if a.slurm]
        if not runs and task is None:
            continue
        ids = list(dict.fromkeys([a.slurm for a in runs] + ([task.job_id] if task is not None else [])))
        nodes = ", ".join(dict.fromkeys(a.host for a in runs)) or (task.node if task is not None else "")
        requeues = max([a.restarts for a in runs] + ([task.restarts] if task is not None else []))
        causes = "; ".join(a.outcome for a in runs[:-1] if a.outcome != "complete")
        now = task.words() if task is not None else ""
        rows.append(f"<tr><td>{s.rank}</td><td>{e(', '.join(ids))}</td><td>{e(nodes)}</td>"
                    f"<td>{_queue_wait(sl.submissions, runs)}</td><td>{requeues}</td><td>{e(causes)}</td>"
                    f"<td>{e(now)}</td></tr>")
    return (f"<h2>SLURM</h2>{hand}<table id='slurm_jobs'><tr><th>submitted</th><th>job array(s) [tasks]</th>"
            f"<th>merge job</th><th>merge job state</th></tr>{''.join(subs)}</table>"
            "<table id='slurm_tasks'><tr><th>shard</th><th>task(s)</th><th>node(s)</th><th>queue wait</th>"
            "<th>requeues</th><th>why it was requeued or stopped</th><th>squeue now</th></tr>"
            f"{''.join(rows)}</table>")


def _queue_wait(submissions: list[dict], runs: list) -> str:
    """From the latest submission before the shard's first attempt after it, to that attempt's start."""
    if not runs:
        return ""
    for sub in reversed(submissions):
        try:
            when = datetime.datetime.strptime(sub["submitted"], "%Y-%m-%dT%H:%M:%S").timestamp()
        except (KeyError, ValueError):
            continue
        after = [a.start for a in runs if a.start >= when - 1]
        if after:
            return _seconds(max(0.0, min(after) - when))
    return ""


def _shard_table(f: RunFacts) -> str:
    e = html.escape
    shown = [s for s in f.shards if len(f.shards) <= LISTED_SHARDS or s.state != "complete"]
    note = "" if len(shown) == len(f.shards) else (
        f"<p>{len(f.shards) - len(shown):,} complete shard(s) not listed; the charts show every shard.</p>")
    rows = "".join(
        f"<tr><td>{s.rank}</td><td class='{e(s.state)}'>{e(s.state)}</td><td>{s.durable:,}</td><td>{s.expected:,}</td>"
        f"<td>{s.residues:,}</td><td>{s.tokens:,}</td><td>{_worker_seconds(s.attempts):.1f}</td>"
        f"<td>{len(s.attempts)}</td><td>{e(s.attempts[-1].outcome if s.attempts else '')}</td></tr>" for s in shown)
    if not shown:
        return note
    return (note + "<table id='shards'><tr><th>shard</th><th>state</th><th>durable rows</th><th>sequences</th>"
            "<th>residues</th><th>tokens</th><th>worker seconds</th><th>attempts</th><th>last attempt</th></tr>"
            f"{rows}</table>")


def _failures(f: RunFacts) -> str:
    e = html.escape
    rows = []
    for s in f.shards:
        for number, a in enumerate(s.attempts, 1):
            if a.outcome != "complete":
                rows.append(f"<tr><td>{s.rank}</td><td>{number} of {len(s.attempts)}</td><td>{_when(a.start)}</td>"
                            f"<td>{e(a.device)}</td><td>{e(a.outcome)}</td></tr>")
    records = "".join(
        f"<details><summary>shard {s.rank}: {e(s.failure.summary())}</summary>"
        f"<pre>{e(chr(10).join(s.failure.log_tail))}</pre></details>"
        for s in f.shards if s.failure)
    restarts = sum(max(0, len(s.attempts) - 1) for s in f.shards)
    if not rows and not records:
        return "<p id='failures'>none: every attempt of every shard finished</p>"
    return (f"<p>{restarts} restart(s) in all.</p><table id='failures'><tr><th>shard</th><th>attempt</th>"
            f"<th>started</th><th>device</th><th>how it ended</th></tr>{''.join(rows)}</table>"
            + (f"<h3>Recorded failures (shards/shard_N.failed.json, with their logs' last lines)</h3>{records}"
               if records else ""))


def _statuses(f: RunFacts) -> str:
    e = html.escape
    if not f.statuses:
        return "<p>no rows yet</p>"
    source = "result.h5" if f.result else "the rows the shards hold so far (no result.h5 yet)"
    rows = "".join(f"<tr><td>{code}</td><td class='text'>{e(status_codes.DESCRIPTIONS.get(code, 'unknown code'))}</td>"
                   f"<td>{n:,}</td><td>{e(', '.join(ids))}</td></tr>" for code, (n, ids) in sorted(f.statuses.items()))
    return (f"<p>From {source}.</p><table id='statuses'><tr><th>status</th><th>meaning</th><th>rows</th>"
            f"<th>examples</th></tr>{rows}</table>" + _variant_statuses(f))


def _variant_statuses(f: RunFacts) -> str:
    """A --task variants result's table by status (a variant takes its record's)."""
    if not f.variant_statuses:
        return ""
    rows = "".join(f"<tr><td>{code}</td><td class='text'>"
                   f"{html.escape(status_codes.DESCRIPTIONS.get(code, 'unknown code'))}</td><td>{n:,}</td></tr>"
                   for code, n in sorted(f.variant_statuses.items()))
    return ("<p>The variants table of result.h5 (each variant has its record's status):</p><table "
            f"id='variant_statuses'><tr><th>status</th><th>meaning</th><th>variants</th></tr>{rows}</table>")


def _pairs(table_id: str, items: dict) -> str:
    e = html.escape
    rows = "".join(f"<tr><td>{e(str(k))}</td><td>{e(_value(v))}</td></tr>" for k, v in sorted(items.items()))
    return f"<table id='{table_id}' class='pairs'>{rows}</table>"


def _value(v) -> str:
    """A setting as the page shows it: many paths (3,000 FASTA files made a 90 KB cell) as a few and how many."""
    if isinstance(v, str):
        return v
    if isinstance(v, list) and len(v) > MANY_FILES and all(isinstance(p, str) for p in v):
        return f"{files_shown(v)} (every one in manifest.json)"
    return json.dumps(v)


STYLE = """body{font-family:sans-serif;margin:2em;max-width:75em;color:#222}
table{border-collapse:collapse;margin:.5em 0} td,th{border:1px solid #ccc;padding:.2em .6em;text-align:right}
td:last-child,td.text{text-align:left} .pairs td{text-align:left} h2{margin-top:1.6em}
.failed,.corrupt,.interrupted{color:#b00} .complete{color:#070} .running{color:#a60}
pre{background:#f6f6f6;padding:.6em;white-space:pre-wrap}"""


def render(f: RunFacts) -> str:
    e = html.escape
    m, config = f.manifest, f.manifest["config"]
    attrs = m.get("attrs", {})
    timings = _timings(f)
    error = f"<h2>What stopped it</h2><pre id='error'>{e(f.error)}</pre>" if f.error else ""
    copies = copy_plan.described_now(m, f.result == "complete", sum(s.durable for s in f.shards))
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>run_shards report: {e(f.root)}</title><style>{STYLE}</style></head><body>
<h1>run_shards report</h1>
{_headline(f)}
{_next_step(f)}
<p>{len(f.lengths):,} sequences in {len(f.shards)} shard(s); task {e(f.task or config['task'])},
model {e(config['model'])}, engine {e(m['engine'])}, dtype {e(str(attrs.get('dtype', config.get('dtype'))))};
run directory {e(f.root)};
report written {e(f.written)} (`{e(command('report', f.root))}` writes it again).</p>
{f"<p id='copies'>Rows: {e(copies)}.</p>" if copies else ""}
{error}
<h2>Sequence lengths</h2>{lengths_chart(f)}
<h2>Shards</h2>{balance_chart(f)}{_shard_table(f)}
<h2>Throughput over time</h2>{throughput_chart(f)}
<h2>Where the time went</h2>{timings}{time_chart(f)}
<h2>Row statuses</h2>{_statuses(f)}
<h2>Failures and restarts</h2>{_failures(f)}
{_slurm_section(f)}
<h2>Model</h2>{_pairs("model", dict(m["model"], engine=m["engine"], limit_tokens=m.get("max_tokens"),
                                    software_version=attrs.get("software_version", "")))}
<h2>Configuration</h2>{_pairs("config", config)}
</body></html>
"""
