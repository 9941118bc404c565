"""What a step prints and keeps: markdown lines and tables printed row by row (the end of a lent GPU's output
may be all that comes back) and appended to OUT/gpu_profile.md as they print; the step's numbers merged into
OUT/gpu_profile.json under the step's name, its headline lines among them (the summary prints those last)."""
from __future__ import annotations

import json
from pathlib import Path

MARKDOWN, NUMBERS = "gpu_profile.md", "gpu_profile.json"


def cell(value) -> str:
    """A table cell: floats with a precision that suits their size, everything else as text."""
    if isinstance(value, float):
        if value != value:   # NaN
            return "-"
        magnitude = abs(value)
        return f"{value:,.0f}" if magnitude >= 100 else f"{value:.2f}" if magnitude >= 1 else f"{value:.3g}"
    return str(value)


class Report:
    def __init__(self, out: Path, step: str, title: str):
        self.out, self.step = out, step
        out.mkdir(parents=True, exist_ok=True)
        self.line(f"\n## {step}: {title}\n")

    def line(self, text: str = "") -> None:
        print(text, flush=True)
        with open(self.out / MARKDOWN, "a") as f:
            f.write(text + "\n")

    def table(self, *headers: str) -> "Table":
        self.line("")
        self.line("| " + " | ".join(headers) + " |")
        self.line("|" + "|".join(" --- " if i == 0 else " ---: " for i in range(len(headers))) + "|")
        return Table(self)

    def keep(self, key: str, value) -> None:
        """A number (or a small structure) into the step's entry of the JSON file, written at once."""
        data = load(self.out)
        data.setdefault(self.step, {})[key] = value
        (self.out / NUMBERS).write_text(json.dumps(data, indent=1, default=str))

    def headline(self, text: str) -> None:
        """A line the summary repeats at the end of the whole run's output."""
        self.line(f"**{text}**")
        data = load(self.out)
        data.setdefault(self.step, {}).setdefault("headline", []).append(text)
        (self.out / NUMBERS).write_text(json.dumps(data, indent=1, default=str))


class Table:
    def __init__(self, report: Report):
        self.report = report

    def row(self, *cells) -> None:
        self.report.line("| " + " | ".join(cell(c) for c in cells) + " |")


def load(out: Path) -> dict:
    path = out / NUMBERS
    return json.loads(path.read_text()) if path.exists() else {}
