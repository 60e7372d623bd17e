"""Digitize the Kimi Linear report's speed figures from the PDF's vector paths (how the CSV was made).

Not run by the book (the PDF is not shipped). To repeat: take ``tech_report.pdf`` from
github.com/MoonshotAI/Kimi-Linear at commit 858dba5, then

    pdftocairo -svg -f 13 -l 13 tech_report.pdf p13.svg   # Figure 7 (a) and (b)
    pdftocairo -svg -f 1 -l 1 tech_report.pdf p1.svg      # Figure 1 (b)
    python digitize_kimi_linear.py p13.svg p1.svg > kimi_linear_speed.csv

Each curve is one pgfplots polyline in the SVG (teal = MLA, purple = Kimi Linear, orange =
GDN-H); its points sit on the x grid 4K, 8K, ..., 1M (2^12 .. 2^20 tokens). y is mapped to
the axis unit through the figure's own horizontal grid lines (the axis ticks).
"""

import re
import sys

SERIES = {"0%,54.508972%,54.508972%": "MLA", "39.99939%,39.99939%,100%": "Kimi Linear",
          "100%,64.99939%,29.998779%": "GDN-H"}
PATH = re.compile(r'<path style="([^"]*)" d="([^"]*)" transform="matrix\(([^)]*)\)"/>')


def curves(svg: str):
    """{transform: {series: [svg y per point]}} and {transform: sorted grid-line y values}."""
    lines, grids = {}, {}
    for style, d, mat in PATH.findall(svg):
        color = re.search(r"stroke:rgb\(([^)]*)\)", style)
        color = color.group(1) if color else None
        pts = [(float(x), float(y)) for x, y in re.findall(r"[ML] ([-\d.]+) ([-\d.]+)", d)]
        if color in SERIES and len(pts) >= 8 and d.count("M") == 1 and "Z" not in d:
            lines.setdefault(mat, {})[SERIES[color]] = [y for _, y in pts]
        elif color == "75%,75%,75%" and len({x for x, _ in pts}) == 2:  # horizontal grid lines
            grids.setdefault(mat, sorted({y for _, y in pts}))
    return lines, grids


def main(p13: str, p1: str) -> None:
    print("figure,series,tokens,svg_y,value,unit")
    panels = []
    for path, ticks in ((p13, [[0, 20, 40, 60], [5, 10, 15]]), (p1, [[0, 5, 10]])):
        lines, grids = curves(open(path).read())
        for mat, tick in zip(lines, ticks):
            panels.append((path, mat, lines[mat], grids[mat], tick))
    names = ["7a prefill latency", "7b TPOT batch 1", "1b TPOT larger batches"]
    units = ["s", "ms", "ms"]
    for name, unit, (_, _, series, grid, tick) in zip(names, units, panels):
        y0, y1 = grid[0], grid[-1]
        v0, v1 = tick[0], tick[len(grid) - 1]
        for label in ("Kimi Linear", "MLA", "GDN-H"):
            points = series.get(label, [])
            if len(points) != 9:  # Figure 1(b)'s GDN-H line lacks a point: its x positions are ambiguous
                continue
            for i, y in enumerate(points):
                value = v0 + (y - y0) / (y1 - y0) * (v1 - v0)
                print(f"{name},{label},{2 ** (12 + i)},{y},{value:.4f},{unit}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
