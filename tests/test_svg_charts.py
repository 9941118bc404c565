"""pipeline/reporting/svg_charts.py: ticks, the geometry of what it draws, the legend's place, escaping."""
from __future__ import annotations

import math
import re
import xml.etree.ElementTree as ET

import pytest

from pipeline.reporting.svg_charts import Axis, Chart, Panel, limits, nice_step, number

NS = "{http://www.w3.org/2000/svg}"


def parsed(svg: str) -> ET.Element:
    return ET.fromstring(svg)   # well-formed XML, or this raises


def frame(root: ET.Element) -> tuple[float, float, float, float]:
    r = root.find(f".//{NS}rect[@class='frame']")
    x, y, w, h = (float(r.get(k)) for k in ("x", "y", "width", "height"))
    return x, y, x + w, y + h


def test_nice_ticks_are_1_2_5_steps_with_thousands_separators():
    assert [nice_step(s) for s in (1234, 0.73, 7, 100)] == [200, 0.2, 2, 20]
    assert Axis(0, 1234).ticks() == [(v, f"{v:,}") for v in range(0, 1201, 200)]
    assert [label for _, label in Axis(0, 0.73).ticks()] == ["0", "0.2", "0.4", "0.6"]
    assert [label for _, label in Axis(0, 2_600_000).ticks()] == ["0", "500,000", "1,000,000", "1,500,000",
                                                                  "2,000,000", "2,500,000"]
    # shard numbers: whole numbers only, however few shards; every one where asked
    assert [v for v, _ in Axis(-0.6, 1.6, integer=True).ticks()] == [0, 1]
    assert [label for _, label in Axis(-0.6, 63.6, integer=True).ticks()] == ["0", "10", "20", "30", "40", "50", "60"]
    assert [v for v, _ in Axis(-0.6, 11.6, integer=True, step=1).ticks()] == list(range(12))
    assert number(0.30000000000000004, 0.1) == "0.3" and number(-0.0) == "0" and number(12345.6) == "12,346"


def test_log_axis_ticks_are_powers_of_ten_a_decade_apart():
    axis = Axis(1, 24_000, log=True)
    assert axis.ticks() == [(1, "1"), (10, "10"), (100, "100"), (1000, "1,000"), (10_000, "10,000")]
    assert [round(axis.fraction(v), 6) for v, _ in axis.ticks()] == [round(k / math.log10(24_000), 6) for k in range(5)]
    assert axis.minor()[:3] == [2, 3, 4] and 20_000 in axis.minor() and 10 not in axis.minor()
    assert [label for _, label in Axis(1, 36, log=True).ticks()] == ["1", "2", "5", "10", "20"]   # under 2 decades

    panel = Panel(axis, Axis(0, 10))
    root = parsed(Chart([panel], 600, 100, legend=False).svg("log"))
    x0, _, x1, y1 = frame(root)
    labels = {t.text: float(t.get("x")) for t in root.iter(f"{NS}text") if float(t.get("y")) > y1}
    decade = (x1 - x0) / math.log10(24_000)
    assert [labels[k] - x0 for k in ("1", "10", "100", "1,000", "10,000")] == \
        pytest.approx([k * decade for k in range(5)], abs=0.11)   # drawn to 0.1 px


def test_bars_and_histogram_bars_have_the_height_and_place_of_their_values():
    panel = Panel(Axis(-0.5, 2.5), Axis(0, 50))
    panel.bars([0, 1, 2], [10, 0, 40], "#55a868")
    hist = Panel(Axis(1, 1000, log=True), Axis(0, 8))
    hist.histogram([1, 10, 100, 1000], [2, 8, 4], "#4c72b0")
    drawing = Chart([panel, hist], 800, 100, legend=False).render("bars")
    root = parsed(drawing.svg)
    (ax0, ay0, ax1, ay1), (bx0, by0, bx1, by1) = [(b.x0, b.y0, b.x1, b.y1) for b in drawing.plots]
    assert ay1 - ay0 == by1 - by0 == 100
    rects = [r for r in root.iter(f"{NS}rect") if r.get("class") != "frame"]
    got = [tuple(float(r.get(k)) for k in ("x", "y", "width", "height")) for r in rects]
    unit = (ax1 - ax0) / 3
    assert got[:2] == [pytest.approx((ax0 + 0.1 * unit, ay1 - 20, 0.8 * unit, 20), abs=0.1),   # 10 of 50: 20 px
                       pytest.approx((ax0 + 2.1 * unit, ay1 - 80, 0.8 * unit, 80), abs=0.1)]   # 0 draws nothing
    third = (bx1 - bx0) / 3
    assert got[2:] == [pytest.approx((bx0 + k * third, by1 - 12.5 * c, third, 12.5 * c), abs=0.1)
                       for k, c in enumerate((2, 8, 4))]
    assert [r.get("fill") for r in rects] == ["#55a868"] * 2 + ["#4c72b0"] * 3


def test_a_step_line_holds_each_value_over_the_interval_it_ends_and_markers_sit_on_points():
    panel = Panel(Axis(0, 4), Axis(0, 10))
    panel.step([0, 1, 4], [5, 5, 10], "#1f77b4", label="speed")
    panel.line([0, 2], [0, 10], "#ff7f0e", label="rows", marker=True, dash=":")
    drawing = Chart([panel], 400, 100).render("lines")
    x0, y0, x1, y1 = (drawing.plots[0].x0, drawing.plots[0].y0, drawing.plots[0].x1, drawing.plots[0].y1)
    unit = (x1 - x0) / 4
    root = parsed(drawing.svg)
    paths = [p for p in root.find(f"{NS}g[@class='panel']").iter(f"{NS}path") if p.get("stroke") != "#333"]
    step = [p.get("d") for p in paths if p.get("stroke") == "#1f77b4"][0]

    def f(v):
        return f"{v:.1f}".rstrip("0").rstrip(".")
    assert step == f"M{f(x0)} {f(y1 - 50)}V{f(y1 - 50)}H{f(x0 + unit)}V{f(y1 - 100)}H{f(x1)}"   # 10 over (1, 4]
    dotted = [p for p in root.iter(f"{NS}path") if p.get("stroke") == "#ff7f0e"]
    assert all(p.get("stroke-dasharray") for p in dotted) and len(dotted) == 2   # the line and its legend entry
    circles = [(float(c.get("cx")), float(c.get("cy"))) for c in root.iter(f"{NS}circle")]
    assert [(x0, y1), (x0 + 2 * unit, y0)] == [pytest.approx(c, abs=0.06) for c in circles if c[1] > y0 - 1]


def test_the_legend_covers_no_data_no_plot_and_no_label():
    """Many entries (12 shards' series) wrap into rows above the panels, clear of every text and data point."""
    speed, rows = (Panel(Axis(0, 100), limits([40_000]), title=t, xlabel="seconds since the worker started",
                         ylabel=y) for t, y in (("throughput", "tokens per second"), ("progress", "rows")))
    for k in range(12):
        speed.step([0, 50, 100], [40_000, 40_000 - k, 40_000], f"#{k:02d}0000", label=f"shard {k}, attempt 2")
        rows.line([0, 100], [0, 40_000], f"#{k:02d}0000", label=f"shard {k}, attempt 2", marker=True)
    drawing = Chart([speed, rows], 960, 180).render("legend")
    legend = drawing.legend
    assert legend is not None and legend.x1 <= drawing.width and legend.y1 - legend.y0 > 30   # wrapped into rows
    entries = [t for t in drawing.texts if t.role == "legend"]
    assert [t.text for t in entries] == [f"shard {k}, attempt 2" for k in range(12)]   # each label once
    assert all(legend.x0 <= t.box.x0 and t.box.x1 <= legend.x1 and legend.y0 <= t.box.y0 and t.box.y1 <= legend.y1
               for t in entries)
    others = [t for t in drawing.texts if t.role != "legend"]
    assert {t.role for t in others} == {"tick", "title", "xlabel", "ylabel"}
    assert not any(legend.overlaps(t.box) for t in others)
    assert not any(legend.overlaps(p) for p in drawing.plots)
    markers = [(float(c.get("cx")), float(c.get("cy"))) for c in parsed(drawing.svg).iter(f"{NS}circle")
               if not (legend.y0 <= float(c.get("cy")) <= legend.y1)]
    assert len(markers) == 24 and all(any(p.x0 <= x <= p.x1 and p.y0 <= y <= p.y1 for p in drawing.plots)
                                      for x, y in markers)
    for a, b in ((t, u) for k, t in enumerate(others) for u in others[k + 1:]):
        assert not a.box.overlaps(b.box), (a.text, b.text)


def test_text_is_escaped_and_the_svg_is_an_image_with_its_label():
    panel = Panel(Axis(0, 1), Axis(0, 1), title="<b>&", note="no checkpoint yet")
    panel.vline(0.5, "#c44e52", label="model's limit (<1> & \"2\")")
    svg = Chart([panel], 300, 80).svg('lengths "a" <b>')
    root = parsed(svg)
    assert root.get("role") == "img" and root.get("aria-label") == 'lengths "a" <b>'
    assert {"<b>&", "model's limit (<1> & \"2\")", "no checkpoint yet"} <= set(root.itertext())
    assert not re.search(r"<(?!/?(svg|title|g|rect|path|circle|text)\b)", svg)   # nothing but the drawing


def test_nothing_in_pipeline_imports_matplotlib():
    """matplotlib is no dependency of run_shards (setup.cfg): an import of it would fail in a fresh install."""
    from pathlib import Path
    rooms = Path(__file__).resolve().parents[1] / "pipeline"
    found = [str(p) for p in rooms.rglob("*.py") if re.search(r"^\s*(import|from)\s+matplotlib", p.read_text(), re.M)]
    assert found == []
