"""OUT/report.html: one self-contained page about a run, finished or not (inline PNG charts drawn with
matplotlib, no network). Every run writes it at its end, and `run_shards report OUT` writes it again.

It reads the run directory alone, through the same readers as `status` (shard_state), the logs' lines
(timings in run.log; checkpoints, restarts and completions in each worker_N.log) and result.h5 when it
exists. Shown: the length histogram with the token budget and the model's limit; per-shard balance
(sequences, tokens, seconds); durable rows over time per shard; the time split; status counts with
example ids; failures and restarts with their reasons; the run's config and model identity.
"""
from __future__ import annotations

import base64
import datetime
import html
import io
import json
import re
from pathlib import Path

import numpy as np

from . import shard_state, status_codes
from .run_dir import RunDir, write_atomic

_STAMP = r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) "


def facts(run: RunDir) -> dict:
    """What the page shows, from the run directory."""
    from index import SequenceIndex
    manifest = run.read_manifest()
    config, world = manifest["config"], manifest["world"]
    index = SequenceIndex.load(run.index_path)
    shards = []
    for r in range(world):
        positions = index.stride_shard(r, world)
        s = shard_state.inspect(run, positions, r, verify_shard=False)
        log = run.worker_log(r).read_text(errors="replace") if run.worker_log(r).exists() else ""
        done = re.findall(r"shard complete: .* \((\d+) sequences, (\d+) tokens, ([\d.]+) s", log)
        failure = run.failure(r) or {}
        shards.append({
            "rank": r, "state": s.state, "durable": s.durable, "expected": s.expected,
            "residues": int(index.lengths[positions].sum(dtype=np.int64)),
            "seconds": float(done[-1][2]) if done else None,
            "starts": log.count("started (pid "),
            "progress": sorted(
                [(_time(t), int(total) - int(todo)) for t, total, todo in
                 re.findall(_STAMP + r".*shard \d+: (\d+) sequences, (\d+) to do", log, re.M)]
                + [(_time(t), int(n)) for t, n in
                   re.findall(_STAMP + r".*checkpoint part_\d+\.h5: \d+ rows(?:, \d+ tokens)? \((\d+) of", log,
                              re.M)]),
            "failure": " - ".join(x for x in (failure.get("explanation"), failure.get("reason")) if x),
        })
    run_log = run.parent_log.read_text(errors="replace") if run.parent_log.exists() else ""
    timings = re.findall(r"timings: prepare ([\d.]+) s, start workers and load model ([\d.]+) s, compute "
                         r"([\d.]+) s, finish shards and merge ([\d.]+) s", run_log)
    statuses, examples, rows = {}, {}, None
    if run.result_path.exists():
        import h5py
        with h5py.File(run.result_path, "r") as f:
            status, ids = f["status"][:], f["ids"]
            rows = len(status)
            for code in np.unique(status):
                where = np.flatnonzero(status == code)
                statuses[int(code)] = len(where)
                examples[int(code)] = [ids[int(i)].decode() if isinstance(ids[int(i)], bytes) else str(ids[int(i)])
                                       for i in where[:3]]
    return {
        "root": str(run.root), "config": config, "model": manifest["model"], "engine": manifest["engine"],
        "max_tokens": manifest.get("max_tokens"), "world": world, "sequences": len(index),
        "lengths": index.lengths, "budget": _budget(config), "shards": shards, "rows": rows,
        "statuses": statuses, "examples": examples,
        "timings": [float(x) for x in timings[-1]] if timings else None,
        "written": datetime.datetime.now().isoformat(timespec="seconds"),
    }


def _time(stamp: str) -> float:
    return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _budget(config: dict) -> int:
    from .config import RunConfig
    return RunConfig.from_json(json.dumps(config)).tokens_per_batch


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt
    plt.close(fig)
    return f'<img alt="chart" src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}">'


def charts(f: dict) -> dict[str, str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out = {}
    fig, ax = plt.subplots(figsize=(7, 3))
    lengths = f["lengths"]
    longest = int(lengths.max()) if len(lengths) else 1
    ax.hist(lengths[lengths > 0], bins=min(60, max(5, len(np.unique(lengths)))), color="#4c72b0")
    for value, label, style in ((f["budget"], "token budget per batch", dict(color="#dd8452", ls="--")),
                                (f["max_tokens"], "model limit", dict(color="#c44e52"))):
        if value and value <= 2 * longest:
            ax.axvline(value, label=f"{label} ({value:,} tokens)", **style)
        elif value:   # far right of every sequence: named, not drawn
            ax.plot([], [], label=f"{label} ({value:,} tokens, beyond the longest)", **style)
    ax.set_xlim(0, max(longest, min(2 * longest, max(f["budget"] or 0, f["max_tokens"] or 0))) * 1.05)
    ax.set_xlabel("residues per sequence")
    ax.set_ylabel("sequences")
    ax.legend(fontsize=8)
    out["lengths"] = _png(fig)
    fig, axes = plt.subplots(1, 3, figsize=(10, 2.6))
    ranks = [s["rank"] for s in f["shards"]]
    for ax, key, label in zip(axes, ("expected", "residues", "seconds"), ("sequences", "residues", "seconds")):
        ax.bar(ranks, [s[key] or 0 for s in f["shards"]], color="#55a868")
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("shard")
        ax.set_xticks(ranks if len(ranks) <= 16 else ranks[::max(1, len(ranks) // 16)])
    out["balance"] = _png(fig)
    fig, ax = plt.subplots(figsize=(7, 3))
    starts = [t for s in f["shards"] for t, _ in s["progress"]]
    t0 = min(starts) if starts else 0
    for s in f["shards"]:
        if s["progress"]:
            ax.plot([t - t0 for t, _ in s["progress"]], [n for _, n in s["progress"]], marker=".",
                    label=f"shard {s['rank']}")
    ax.set_xlabel("seconds since the first worker started")
    ax.set_ylabel("durable rows")
    if starts:
        ax.legend(fontsize=8)
    out["progress"] = _png(fig)
    if f["timings"]:
        fig, ax = plt.subplots(figsize=(7, 1.4))
        left = 0.0
        for value, label, color in zip(f["timings"], ("prepare", "start and load", "compute", "finish and merge"),
                                       ("#8172b3", "#ccb974", "#4c72b0", "#64b5cd")):
            ax.barh([0], [value], left=left, color=color, label=f"{label} {value:.1f} s")
            left += value
        ax.set_yticks([])
        ax.set_xlabel("seconds")
        ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.6))
        out["timings"] = _png(fig)
    return out


def _timings_text(f: dict) -> str:
    if not f["timings"]:
        return ""
    parts = zip(("prepare", "start workers and load model", "compute", "finish shards and merge"), f["timings"])
    return '<p id="timings">' + ", ".join(f"{name} {value:.1f} s" for name, value in parts) + "</p>"


def _seconds(shard: dict) -> str:
    return "" if shard["seconds"] is None else f"{shard['seconds']:.1f}"


def render(f: dict) -> str:
    e = html.escape
    img = charts(f)
    done = sum(s["state"] == "complete" for s in f["shards"])
    headline = (f"result: {e(f['root'])}/result.h5, {f['rows']:,} rows" if f["rows"] is not None else
                f"no result yet: {done} of {f['world']} shard(s) complete")
    shard_rows = "".join(
        f"<tr><td>{s['rank']}</td><td class='{e(s['state'])}'>{e(s['state'])}</td><td>{s['durable']:,}</td>"
        f"<td>{s['expected']:,}</td><td>{s['residues']:,}</td>"
        f"<td>{_seconds(s)}</td>"
        f"<td>{max(0, s['starts'] - 1)}</td><td>{e(s['failure'])}</td></tr>" for s in f["shards"])
    status_rows = "".join(
        f"<tr><td>{code}</td><td>{e(status_codes.DESCRIPTIONS.get(code, ''))}</td><td>{n:,}</td>"
        f"<td>{e(', '.join(f['examples'][code]))}</td></tr>" for code, n in sorted(f["statuses"].items()))
    failures = [s for s in f["shards"] if s["failure"]]
    config = "".join(f"<tr><td>{e(k)}</td><td>{e(json.dumps(v))}</td></tr>" for k, v in sorted(f["config"].items()))
    model = "".join(f"<tr><td>{e(k)}</td><td>{e(str(v))}</td></tr>" for k, v in sorted(f["model"].items()))
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>run_shards report: {e(f['root'])}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:60em}} table{{border-collapse:collapse;margin:.5em 0}}
td,th{{border:1px solid #ccc;padding:.2em .6em;text-align:right}} td:last-child{{text-align:left}}
.failed,.corrupt{{color:#b00}} .complete{{color:#070}} h2{{margin-top:1.5em}}</style></head><body>
<h1>run_shards report</h1>
<p id="headline">{headline}</p>
<p>{f['sequences']:,} sequences in {f['world']} shard(s); task {e(f['config']['task'])}, engine {e(f['engine'])};
report written {e(f['written'])}.</p>
<h2>Sequence lengths</h2>{img['lengths']}
<h2>Shards</h2>{img['balance']}
<table id="shards"><tr><th>shard</th><th>state</th><th>durable</th><th>sequences</th><th>residues</th><th>seconds</th>
<th>restarts</th><th>failure</th></tr>{shard_rows}</table>
<h2>Progress</h2>{img['progress']}
<h2>Time</h2>{img.get('timings', '<p>no timings line in run.log (the run did not finish)</p>')}
{_timings_text(f)}
<h2>Status of the rows</h2>
{'<table id="statuses"><tr><th>status</th><th>meaning</th><th>rows</th><th>examples</th></tr>' + status_rows + '</table>'
 if f['statuses'] else '<p>no result.h5 yet</p>'}
<h2>Failures</h2>
{''.join(f"<p class='failed'>shard {s['rank']}: {e(s['failure'])}</p>" for s in failures) or '<p>none</p>'}
<h2>Configuration</h2><table>{config}</table>
<h2>Model</h2><table>{model}</table>
</body></html>
"""


def write(out: str | Path) -> Path:
    """Write OUT/report.html (atomically); its path."""
    run = RunDir(str(out))
    page = render(facts(run))
    path = run.root / "report.html"
    write_atomic(path, page)
    return path
