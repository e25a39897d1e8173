"""Sphinx directive ``.. benchmark-tables::``: the recorded benchmark run, as tables.

The figures come from ``benchmarks/results/latest.json``, written by
``benchmarks/bench.py``, through the same report code that writes the tables of
``benchmarks/README.md`` (``benchmarks/report.py``'s ``markdown()``). Nothing is
copied by hand, so the docs show exactly the recorded run. The report's small
Markdown subset (paragraphs, ``### headings``, pipe tables and images) is turned
into reStructuredText here. The plots are the PNGs ``bench.py`` drew from the
same file into ``benchmarks/results/`` (``bench.py --render`` redraws them).

``.. benchmark-topologies::`` inserts only the table of the ``topologies``
scenario (this app's lock on one Redis, Sentinel, Redis Cluster and Redlock
quorums), from the same file and the same report code.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "latest.json"
# The plots, relative to the document that shows them (docs/benchmarks.rst).
PLOTS = "../benchmarks/results"


def _report_markdown(results: dict[str, Any], part: str = "all") -> str:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import report  # benchmarks/report.py

        if part == "topologies":
            return "\n".join(report.topologies_section(results))
        plots = sorted(p.name for p in RESULTS.parent.glob("*.png"))
        return str(report.markdown(results, plots=plots))
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _list_table(rows: list[list[str]]) -> list[str]:
    header, body = rows[0], rows[1:]
    out = [".. list-table::", "   :header-rows: 1", ""]
    for row in [header, *body]:
        row = row + [""] * (len(header) - len(row))
        out.append(f"   * - {row[0] or ' '}")
        out += [f"     - {cell or ' '}" for cell in row[1:]]
    return [*out, ""]


def markdown_to_rst(text: str) -> list[str]:
    """Return reStructuredText lines for the report's Markdown: paragraphs, headings, tables."""
    out: list[str] = []
    table: list[list[str]] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            if not set(line.replace("|", "").strip()) <= {"-", ":"}:
                table.append(_cells(line))
            continue
        if table:
            out += _list_table(table)
            table = []
        if line.startswith("### "):
            out += [f".. rubric:: {line[4:].strip()}", ""]
        elif line.startswith("![") and "](results/" in line:
            name = line.split("](results/", 1)[1].rstrip(")")
            out += [f".. image:: {PLOTS}/{name}", f"   :alt: {name}", ""]
        elif not line.startswith("!["):
            # Markdown's `code` is RST's ``code``; its *emphasis* is the same.
            out.append(line.replace("``", "`").replace("`", "``"))
    return out


class BenchmarkTables(SphinxDirective):
    """Insert the tables of the recorded benchmark run."""

    has_content = False
    part = "all"

    def run(self) -> list[nodes.Node]:
        self.env.note_dependency(str(RESULTS))
        results = json.loads(RESULTS.read_text())
        container = nodes.section()
        container.document = self.state.document
        lines = markdown_to_rst(_report_markdown(results, self.part))
        if not lines or not any(line.strip() for line in lines):
            lines = [f"No {self.part} results recorded yet in the results file.", ""]
        self.state.nested_parse(StringList(lines, str(RESULTS)), self.content_offset, container)
        return list(container.children)


class BenchmarkTopologies(BenchmarkTables):
    """Insert the per-topology table of the recorded benchmark run."""

    part = "topologies"


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("benchmark-tables", BenchmarkTables)
    app.add_directive("benchmark-topologies", BenchmarkTopologies)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
