"""Sphinx directive ``.. lua-scripts::``: every lock script with its KEYS, ARGV and reply.

Written at build time from the contracts in ``django_redis_mutex/scripts.py``
(``SCRIPTS``), which ``tests/test_script_contracts.py`` checks against the Lua
itself: the page cannot fall behind the scripts, and nothing generated is
committed.
"""

from __future__ import annotations

from typing import Any

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective

from django_redis_mutex import scripts


def _text(contract: str) -> str:
    """Return contract text as reStructuredText: Lua's empty string ``''`` as code, not quotes."""
    return contract.replace("''", "``''``")


def _item(number: int, name: str) -> str:
    """Return one KEYS or ARGV entry: its role as code, what it is, whether it may be left out."""
    optional = name.startswith("[")
    role, _, detail = name.strip("[]").partition(": ")
    text = f"``{role}``" + (f": {_text(detail)}" if detail else "")
    return f"   {number}. {text}" + (" (optional)" if optional else "")


def script_lines(script: scripts.LuaScript) -> list[str]:
    """Return the reStructuredText of one script's contract."""
    lines = [f".. rubric:: {script.name.upper()}", "", script.summary, ""]
    for label, names in (("KEYS", script.keys), ("ARGV", script.argv)):
        lines.append(f":{label}:" + ("" if names else " none"))
        lines += [_item(number, name) for number, name in enumerate(names, 1)]
    return [*lines, f":Reply: {_text(script.returns)}", ""]


class LuaScripts(SphinxDirective):
    """Insert the contract of every lock script."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        self.env.note_dependency(scripts.__file__)
        container = nodes.section()
        container.document = self.state.document
        lines = [line for script in scripts.SCRIPTS for line in script_lines(script)]
        self.state.nested_parse(StringList(lines, scripts.__file__), self.content_offset, container)
        return list(container.children)


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("lua-scripts", LuaScripts)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
