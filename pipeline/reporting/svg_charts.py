"""Plain SVG charts drawn from numbers, for report.html: panels side by side, each with linear, log-10 or
categorical axes, "nice" ticks (1-2-5 steps, powers of ten on a log axis, thousands separators), bars,
histogram bars, step and line series with markers, vertical reference lines, stacked horizontal bars, a
centred note; one legend for the chart, in a band above the panels, so it covers no data and no label.

No font metrics exist outside a browser: text widths are estimated from DejaVu Sans' glyph widths, never
below the real width, so that texts laid out apart here stay apart on screen (tests/test_report.py measures
them in Chromium).
"""
from __future__ import annotations

import html
import math
from dataclasses import dataclass, field


TICK_SIZE, LABEL_SIZE, TITLE_SIZE = 10.0, 11.0, 11.0   # px
TICK_LENGTH, PAD, LINE_GAP = 4.0, 4.0, 1.3
ASCENT, DESCENT = 0.93, 0.24                            # DejaVu Sans', in em: a text's box about its baseline
SWATCH = 22.0                                           # a legend entry's line or patch
CYCLE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
         "#17becf")                                     # series colours, in turn (matplotlib's, as before)
DASHES = {"-": "", "--": "6,3", ":": "1.5,2.5"}

_NARROW, _WIDE = set("ijlftrI.,:;'!|()[] -/"), set("mwMW%@#=+<>~&")


def text_width(text: str, size: float) -> float:
    """An upper bound of the text's width in px in DejaVu Sans (the widest common sans-serif)."""
    em = sum(0.42 if c in _NARROW else 1.0 if c in _WIDE else 0.79 if c.isupper() else 0.65 for c in text)
    return em * size


@dataclass(frozen=True)
class Box:
    x0: float
    y0: float
    x1: float
    y1: float

    def overlaps(self, other: Box) -> bool:
        return self.x0 < other.x1 and other.x0 < self.x1 and self.y0 < other.y1 and other.y0 < self.y1


def nice_step(span: float, count: int = 5) -> float:
    """The 1-2-5 step that cuts `span` into about `count` pieces (at most 4/3 as many)."""
    raw = 0.75 * span / max(count, 1) if span > 0 else 1.0
    magnitude = 10.0 ** math.floor(math.log10(raw))
    return next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw * 0.999)


def number(value: float, step: float = 1.0) -> str:
    """`value` with thousands separators and as many decimals as `step` needs."""
    decimals = max(0, -math.floor(math.log10(step) + 1e-9)) if step < 1 else 0
    text = f"{value:,.{decimals}f}"
    return "0" if text.strip("-0.,") == "" else text


@dataclass
class Axis:
    """Data limits and how values map onto them; `names`: a categorical axis (value k is names[k], the first at
    the top), which may have none yet."""
    lo: float
    hi: float
    log: bool = False
    integer: bool = False
    names: tuple[str, ...] | None = None
    step: float = 0.0          # the ticks' step (0: a nice one)

    def __post_init__(self):
        if self.log:
            assert 0 < self.lo < self.hi, (self.lo, self.hi)
        elif self.hi <= self.lo:
            self.hi = self.lo + 1.0

    def fraction(self, value: float) -> float:
        """Where `value` lies between lo (0) and hi (1)."""
        if self.log:
            return (math.log10(value) - math.log10(self.lo)) / (math.log10(self.hi) - math.log10(self.lo))
        return (value - self.lo) / (self.hi - self.lo)

    def ticks(self) -> list[tuple[float, str]]:
        if self.names is not None:
            return [(float(k), name) for k, name in enumerate(self.names)]
        if self.log:
            first, last = math.ceil(math.log10(self.lo) - 1e-9), math.floor(math.log10(self.hi) + 1e-9)
            marks = (1,) if last - first >= 2 else (1, 2, 5)   # under three powers of ten: 1-2-5 as well
            values = [m * 10.0 ** e for e in range(first - 1, last + 1) for m in marks]
            return [(v, number(v, min(v, 1.0))) for v in values if self.lo * 0.999 <= v <= self.hi * 1.001]
        step = self.step or nice_step(self.hi - self.lo)
        if self.integer:
            step = max(1.0, round(step))
        start = math.ceil(self.lo / step - 1e-9)
        values = [k * step for k in range(start, int(math.floor(self.hi / step + 1e-9)) + 1)]
        return [(v, number(v, step)) for v in values]

    def minor(self) -> list[float]:
        """A log axis' unlabelled ticks: 2..9 times each power of ten."""
        if not self.log:
            return []
        labelled = {v for v, _ in self.ticks()}
        first, last = math.floor(math.log10(self.lo)), math.ceil(math.log10(self.hi))
        return [m * 10.0 ** e for e in range(first, last + 1) for m in range(2, 10)
                if self.lo <= m * 10.0 ** e <= self.hi and m * 10.0 ** e not in labelled]


def limits(values, integer: bool = False, pad: float = 0.05) -> Axis:
    """A linear axis from 0 to a little above the largest value (bars and counts start at zero)."""
    top = max([float(v) for v in values] + [0.0])
    return Axis(0.0, top * (1 + pad) if top > 0 else 1.0, integer=integer)


@dataclass
class Mark:
    """One thing drawn in a panel, in data coordinates; `label` puts it in the legend."""
    kind: str                  # bars, hbars, step, line, vline
    xs: list[float]
    ys: list[float]
    color: str
    label: str = ""
    width: float = 0.8         # bars: in data units; lines: stroke px
    x_ends: list[float] | None = None  # bars from xs[k] to x_ends[k] (histogram, hbars); else `width` about xs[k]
    dash: str = "-"
    marker: bool = False
    edge: str = ""             # a bar's outline colour (none: "")


@dataclass
class Panel:
    """One plot area with its axes and what is drawn in it."""
    x: Axis
    y: Axis
    title: str = ""
    xlabel: str = ""
    ylabel: str = ""
    note: str = ""             # centred text in an empty panel ("no checkpoint yet")
    marks: list[Mark] = field(default_factory=list)

    def bars(self, xs, heights, color: str, width: float = 0.8, label: str = "") -> None:
        self.marks.append(Mark("bars", list(map(float, xs)), list(map(float, heights)), color, label, width))

    def histogram(self, edges, counts, color: str, label: str = "") -> None:
        """Bars from edges[k] to edges[k + 1], counts[k] high."""
        self.marks.append(Mark("bars", [float(e) for e in edges[:-1]], list(map(float, counts)), color, label,
                               x_ends=[float(e) for e in edges[1:]]))

    def hbar(self, row: int, left: float, length: float, color: str, label: str = "", edge: str = "") -> None:
        """A horizontal bar in row `row` of a categorical y axis, from `left` on; bars end to end stack."""
        self.marks.append(Mark("hbars", [float(left)], [float(row)], color, label, x_ends=[float(left + length)],
                               edge=edge))

    def step(self, xs, ys, color: str, label: str = "", dash: str = "-", width: float = 1.5) -> None:
        """A step line: ys[k] holds from xs[k - 1] to xs[k] (the value over the interval that ends at xs[k])."""
        self.marks.append(Mark("step", list(map(float, xs)), list(map(float, ys)), color, label, width, dash=dash))

    def line(self, xs, ys, color: str, label: str = "", dash: str = "-", width: float = 1.5,
             marker: bool = False) -> None:
        self.marks.append(Mark("line", list(map(float, xs)), list(map(float, ys)), color, label, width, dash=dash,
                               marker=marker))

    def vline(self, x: float, color: str, label: str = "", dash: str = "-", width: float = 1.5) -> None:
        self.marks.append(Mark("vline", [float(x)], [], color, label, width, dash=dash))


@dataclass
class Text:
    box: Box
    text: str
    role: str                  # tick, xlabel, ylabel, title, legend, note


@dataclass
class Drawing:
    """The SVG and where its parts lie (px, y down), for tests and anyone laying out around it."""
    svg: str
    width: float
    height: float
    plots: list[Box]
    legend: Box | None
    texts: list[Text]


def _f(v: float) -> str:
    return f"{v:.1f}".rstrip("0").rstrip(".")


def _stroke(color: str, width: float, dash: str) -> str:
    dashes = DASHES.get(dash, dash)
    return (f'fill="none" stroke="{color}" stroke-width="{_f(width)}"'
            + (f' stroke-dasharray="{dashes}"' if dashes else ""))


class Chart:
    """Panels side by side, `plot_height` px high each, the chart `width` px wide, with one legend above
    them (the labelled marks of every panel, each label once) when `legend` is set."""

    def __init__(self, panels: list[Panel], width: float, plot_height: float, legend: bool = True):
        self.panels, self.width, self.plot_height, self.legend = panels, width, plot_height, legend

    def entries(self) -> list[Mark]:
        seen, out = set(), []
        for p in self.panels:
            for m in p.marks:
                if m.label and m.label not in seen:
                    seen.add(m.label)
                    out.append(m)
        return out

    def render(self, label: str) -> Drawing:
        e, out, texts = html.escape, [], []

        def text(x, y, s, size, role, anchor="middle", rotate=False):
            w = text_width(s, size)
            x0 = {"start": x, "middle": x - w / 2, "end": x - w}[anchor]
            box = Box(x0, y - size * ASCENT, x0 + w, y + size * DESCENT)   # y: the baseline
            if rotate:   # a quarter turn anticlockwise about (x, y)
                box = Box(x - size * ASCENT, y - (box.x1 - x), x + size * DESCENT, y + (x - box.x0))
            texts.append(Text(box, s, role))
            out.append(f'<text x="{_f(x)}" y="{_f(y)}" font-size="{_f(size)}" text-anchor="{anchor}"'
                       + (f' transform="rotate(-90 {_f(x)} {_f(y)})"' if rotate else "") + f">{e(s)}</text>")

        # Horizontal layout: each panel's left margin holds its y label and tick labels.
        lefts = []
        for p in self.panels:
            widest = max([text_width(t, TICK_SIZE) for _, t in p.y.ticks()] + [0.0])
            lefts.append(PAD + (LABEL_SIZE * LINE_GAP if p.ylabel else 0) + widest + TICK_LENGTH + PAD)
        last_ticks = [p.x.ticks()[-1][1] for p in self.panels if p.x.ticks()]   # may stand out past the plot
        right = PAD + max([text_width(t, TICK_SIZE) / 2 for t in last_ticks] + [0.0])
        plot_w = (self.width - sum(lefts) - right * len(self.panels)) / len(self.panels)
        assert plot_w > 40, f"a chart {self.width} px wide cannot hold {len(self.panels)} panel(s)"

        # Vertical layout: the legend band, the titles, the plots, tick labels and x labels.
        top, legend_box, rows = PAD, None, []
        entries = self.entries() if self.legend else []
        if entries:   # entries left to right from the first plot's left edge, wrapped at the last one's right
            row, x, ends = [], lefts[0], []
            for m in entries:
                w = SWATCH + PAD + text_width(m.label, TICK_SIZE)
                if row and x + w > self.width - right:
                    rows.append(row)
                    row, x = [], lefts[0]
                row.append((x, m))
                ends.append(x + w)
                x += w + 3 * PAD
            rows.append(row)
            legend_box = Box(lefts[0] - PAD, top, max(ends) + PAD, top + len(rows) * TICK_SIZE * 1.6 + PAD)
            top = legend_box.y1 + PAD
        if any(p.title for p in self.panels):
            top += TITLE_SIZE * LINE_GAP
        plot_top = top + PAD
        plot_bottom = plot_top + self.plot_height
        height = plot_bottom + TICK_LENGTH + TICK_SIZE * LINE_GAP + (
            LABEL_SIZE * LINE_GAP if any(p.xlabel for p in self.panels) else 0) + PAD

        if legend_box is not None:
            self._legend(rows, legend_box, out, text)
        plots, x0 = [], 0.0
        for p, left in zip(self.panels, lefts):
            box = Box(x0 + left, plot_top, x0 + left + plot_w, plot_bottom)
            plots.append(box)
            self._panel(p, box, x0, out, text)
            x0 = box.x1 + right
        svg = (f'<svg xmlns="http://www.w3.org/2000/svg" role="img" aria-label="{e(label)}" width="{_f(self.width)}" '
               f'height="{_f(height)}" viewBox="0 0 {_f(self.width)} {_f(height)}" '
               'font-family="DejaVu Sans, sans-serif">'
               f'<title>{e(label)}</title>' + "".join(out) + "</svg>")
        return Drawing(svg, self.width, height, plots, legend_box, texts)

    def svg(self, label: str) -> str:
        return self.render(label).svg

    @staticmethod
    def _legend(rows: list[list[tuple[float, Mark]]], box: Box, out: list[str], text) -> None:
        """The legend's frame, and each entry's swatch (a patch, or a line with its marker) and label."""
        out.append(f'<g class="legend"><rect x="{_f(box.x0)}" y="{_f(box.y0)}" width="{_f(box.x1 - box.x0)}" '
                   f'height="{_f(box.y1 - box.y0)}" fill="white" stroke="#ddd"/>')
        for k, row in enumerate(rows):
            y = box.y0 + PAD / 2 + (k + 0.5) * TICK_SIZE * 1.6
            for x, m in row:
                if m.kind in ("bars", "hbars"):
                    out.append(f'<rect x="{_f(x)}" y="{_f(y - 4)}" width="{_f(SWATCH)}" height="8" fill="{m.color}"/>')
                else:
                    out.append(f'<path d="M{_f(x)} {_f(y)}h{_f(SWATCH)}" {_stroke(m.color, m.width, m.dash)}/>')
                    if m.marker:
                        out.append(f'<circle cx="{_f(x + SWATCH / 2)}" cy="{_f(y)}" r="2" fill="{m.color}"/>')
                text(x + SWATCH + PAD, y + TICK_SIZE * 0.35, m.label, TICK_SIZE, "legend", anchor="start")
        out.append("</g>")

    @staticmethod
    def _panel(p: Panel, box: Box, x_left: float, out: list[str], text) -> None:
        w, h = box.x1 - box.x0, box.y1 - box.y0

        def px(v):
            return box.x0 + p.x.fraction(v) * w

        def py(v):   # a categorical axis runs top down (first name at the top)
            f = p.y.fraction(v)
            return box.y0 + f * h if p.y.names is not None else box.y1 - f * h

        out.append('<g class="panel">')
        for m in p.marks:
            if m.kind == "bars":
                for k, (x, y) in enumerate(zip(m.xs, m.ys)):
                    if y <= 0:
                        continue
                    a, b = (px(x), px(m.x_ends[k])) if m.x_ends else (px(x - m.width / 2), px(x + m.width / 2))
                    out.append(f'<rect x="{_f(a)}" y="{_f(py(y))}" width="{_f(b - a)}" height="{_f(py(0) - py(y))}" '
                               f'fill="{m.color}"/>')
            elif m.kind == "hbars":
                a, b = px(m.xs[0]), px(m.x_ends[0])
                top, bottom = py(m.ys[0] - 0.4), py(m.ys[0] + 0.4)
                out.append(f'<rect x="{_f(a)}" y="{_f(top)}" width="{_f(b - a)}" height="{_f(bottom - top)}" '
                           f'fill="{m.color}"' + (f' stroke="{m.edge}" stroke-width="1"' if m.edge else "") + "/>")
            elif m.kind == "vline":
                out.append(f'<path d="M{_f(px(m.xs[0]))} {_f(box.y0)}V{_f(box.y1)}" '
                           f'{_stroke(m.color, m.width, m.dash)}/>')
            elif m.xs:
                points = [(px(x), py(y)) for x, y in zip(m.xs, m.ys)]
                d = f"M{_f(points[0][0])} {_f(points[0][1])}"
                for x, y in points[1:]:
                    d += f"V{_f(y)}H{_f(x)}" if m.kind == "step" else f"L{_f(x)} {_f(y)}"
                out.append(f'<path d="{d}" {_stroke(m.color, m.width, m.dash)}/>')
                if m.marker:
                    out.extend(f'<circle cx="{_f(x)}" cy="{_f(y)}" r="2" fill="{m.color}"/>' for x, y in points)
        out.append(f'<rect class="frame" x="{_f(box.x0)}" y="{_f(box.y0)}" width="{_f(w)}" height="{_f(h)}" '
                   'fill="none" stroke="#333" stroke-width="0.8"/>')
        ticks = []
        for v, name in p.x.ticks():
            x = px(v)
            ticks.append(f"M{_f(x)} {_f(box.y1)}v{_f(TICK_LENGTH)}")
            text(x, box.y1 + TICK_LENGTH + TICK_SIZE, name, TICK_SIZE, "tick")
        ticks += [f"M{_f(px(v))} {_f(box.y1)}v{_f(TICK_LENGTH / 2)}" for v in p.x.minor()]
        for v, name in p.y.ticks():
            y = py(v)
            ticks.append(f"M{_f(box.x0)} {_f(y)}h{_f(-TICK_LENGTH)}")
            text(box.x0 - TICK_LENGTH - PAD / 2, y + TICK_SIZE * 0.35, name, TICK_SIZE, "tick", anchor="end")
        out.append(f'<path d="{"".join(ticks)}" stroke="#333" stroke-width="0.8"/>')
        if p.title:
            text((box.x0 + box.x1) / 2, box.y0 - PAD - TITLE_SIZE * 0.3, p.title, TITLE_SIZE, "title")
        if p.xlabel:
            text((box.x0 + box.x1) / 2, box.y1 + TICK_LENGTH + TICK_SIZE * LINE_GAP + LABEL_SIZE, p.xlabel,
                 LABEL_SIZE, "xlabel")
        if p.ylabel:
            text(x_left + PAD + LABEL_SIZE * 0.8, (box.y0 + box.y1) / 2, p.ylabel, LABEL_SIZE, "ylabel", rotate=True)
        if p.note:
            text((box.x0 + box.x1) / 2, (box.y0 + box.y1) / 2, p.note, LABEL_SIZE, "note")
        out.append("</g>")

