"""Medians over repeated runs of the whole comparison.

Every run produces the same tree of results; :func:`median_tree` walks the
runs' trees side by side and keeps, at each number, the median of the runs'
values (NaN values, from a run where something could not be measured, are left
out). Lists of numbers of one length are taken element by element; lists of
strings (error messages) are merged; any other value comes from the first run.
Ratios are computed inside each run (paired by round) before this, so a median
of ratios is what the tables show, never a ratio of medians.
"""

from __future__ import annotations

import math
import statistics
from typing import Any


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def median_tree(values: list[Any]) -> Any:
    """Return the element-wise median of same-shaped results (see the module docstring)."""
    if not values:
        return None
    first = values[0]
    if all(isinstance(v, dict) for v in values):
        keys: list[str] = []
        for value in values:
            keys += [k for k in value if k not in keys]
        return {k: median_tree([v[k] for v in values if k in v]) for k in keys}
    if all(isinstance(v, bool) for v in values):
        return all(values)
    if all(_is_number(v) for v in values):
        finite = [float(v) for v in values if not math.isnan(v)]
        if not finite:
            return math.nan
        middle = statistics.median(finite)
        if all(isinstance(v, int) for v in values) and float(middle).is_integer():
            return int(middle)
        return middle
    if all(isinstance(v, list) for v in values):
        if all(isinstance(item, str) for v in values for item in v):
            merged: list[str] = []
            for value in values:
                merged += [item for item in value if item not in merged]
            return merged
        if len({len(v) for v in values}) == 1:
            return [median_tree(list(items)) for items in zip(*values, strict=True)]
    return first


def per_run(runs: list[dict[str, Any]], path: list[str]) -> list[Any]:
    """Return the value at ``path`` in every run (None where a run lacks it)."""
    found = []
    for run in runs:
        node: Any = run
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        found.append(node)
    return found
