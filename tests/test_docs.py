"""Every Python example in README.rst and docs/ runs, against the suite's Redis.

An example a reader copies must work as printed. Each ``.. code-block:: python``
runs in document order in one namespace per document, with Django configured by
the suite's settings, so ``mutex("inventory")`` really locks on the test
Redis; settings examples (``CACHES = {...}``) run as plain assignments. An
example that cannot run on its own (a model class needs an installed app) is
preceded by a ``.. fragment: <why>`` comment and is only compiled.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from django_redis_mutex import held_locks

from .helpers import ROOT

DOCUMENTS = [ROOT / "README.rst", *sorted((ROOT / "docs").glob("*.rst"))]
DIRECTIVE = re.compile(r"^(\s*)\.\. code-block::\s*(\S+)\s*$")
FRAGMENT = re.compile(r"^\s*\.\. fragment:\s*\S")


@dataclass(frozen=True)
class Block:
    document: Path
    line: int  # 1-based line of the first line of code
    language: str
    code: str
    fragment: bool

    @property
    def where(self) -> str:
        return f"{self.document.relative_to(ROOT)}:{self.line}"


def blocks_of(document: Path) -> list[Block]:
    """Return the code blocks of one reStructuredText document, in order."""
    lines = document.read_text().splitlines()
    found = []
    for index, line in enumerate(lines):
        match = DIRECTIVE.match(line)
        if not match:
            continue
        indent = len(match.group(1))
        previous = next((text for text in reversed(lines[:index]) if text.strip()), "")
        body: list[str] = []
        start = None
        for number in range(index + 1, len(lines)):
            text = lines[number]
            if text.strip() and len(text) - len(text.lstrip()) <= indent:
                break
            if text.strip() and start is None:
                start = number + 1
            if start is not None:
                body.append(text)
        found.append(
            Block(
                document=document,
                line=start or index + 1,
                language=match.group(2),
                code=textwrap.dedent("\n".join(body)).strip() + "\n",
                fragment=bool(FRAGMENT.match(previous)),
            )
        )
    return found


def python_blocks(document: Path) -> list[Block]:
    return [block for block in blocks_of(document) if block.language == "python"]


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: path.name)
def test_every_python_example_of_a_document_runs(document: Path, django_db_blocker: Any) -> None:
    namespace: dict[str, object] = {"__name__": f"docs_{document.stem}"}
    ran = 0
    for block in python_blocks(document):
        compiled = compile(block.code, block.where, "exec")
        if block.fragment:
            continue
        try:
            # Examples may open transactions (on the suite's in-memory database).
            with django_db_blocker.unblock():
                exec(compiled, namespace)
        except Exception as exc:
            pytest.fail(f"the example at {block.where} raised {exc!r}")
        ran += 1
    # An example that took a lock gave it back: nothing is left held.
    assert held_locks() == []
    fragments = sum(block.fragment for block in python_blocks(document))
    assert ran + fragments == len(python_blocks(document))


def test_the_documents_have_runnable_examples() -> None:
    """Guard the collector itself: it must find the examples that exist."""
    runnable = {
        doc.name: sum(not block.fragment for block in python_blocks(doc)) for doc in DOCUMENTS
    }
    for name in ("README.rst", "usage.rst", "operations.rst", "settings.rst"):
        assert runnable[name] >= 1, f"{name} has no runnable Python example"
    assert sum(runnable.values()) >= 15


def test_fragments_are_rare_and_say_why() -> None:
    fragments = [block for doc in DOCUMENTS for block in python_blocks(doc) if block.fragment]
    total = sum(len(python_blocks(doc)) for doc in DOCUMENTS)
    assert len(fragments) * 4 <= total, [block.where for block in fragments]


def test_no_python_hides_in_a_plain_literal_block() -> None:
    """A ``::`` literal block that looks like Python would escape the runner."""
    looks_like_python = re.compile(r"^\s+(from \S+ import |import \S+$|def \w+\(|class \w+)")
    offenders = []
    for document in DOCUMENTS:
        lines = document.read_text().splitlines()
        for index, line in enumerate(lines):
            if line.rstrip().endswith("::") and not line.lstrip().startswith(".."):
                following = next((text for text in lines[index + 1 :] if text.strip()), "")
                if looks_like_python.match(following):
                    offenders.append(f"{document.relative_to(ROOT)}:{index + 1}")
    assert offenders == []


def test_install_commands_install_into_the_active_environment() -> None:
    """A bare ``pip`` is the first on PATH, which after ``uv venv`` is often not the venv's."""
    installs = [
        (block.where, line)
        for document in DOCUMENTS
        for block in blocks_of(document)
        if block.language == "console"
        for line in block.code.splitlines()
        if " install " in line
    ]
    assert len(installs) >= 4, installs  # the collector finds README's and install.rst's
    bare = [
        (where, line)
        for where, line in installs
        if not re.match(r"\$ (python -m pip|uv pip|uv sync|uv build)\b", line.strip())
    ]
    assert bare == []
