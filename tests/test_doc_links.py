"""``scripts/check_doc_links.py`` finds internal links of a built site that lead nowhere.

CI runs the script on the real site right after the docs build; these tests
run it on a few hand-written pages, so nothing is built here.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from .helpers import ROOT

SCRIPT = ROOT / "scripts" / "check_doc_links.py"


@pytest.fixture(scope="module")
def checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_doc_links", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def site(root: Path, pages: dict[str, str]) -> Path:
    for name, body in pages.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"<!DOCTYPE html><html><body>{body}</body></html>")
    return root


def broken(checker: ModuleType, root: Path) -> list[str]:
    return [str(link) for link in checker.broken_links(root)]


def test_links_to_existing_pages_and_ids_pass(checker: ModuleType, tmp_path: Path) -> None:
    root = site(
        tmp_path,
        {
            "index.html": '<a href="api.html#pkg.Thing">Thing</a> <a href="#top">top</a>'
            '<span id="top"></span> <a href="https://example.com/x.html#nowhere">out</a>'
            '<a href="mailto:a@example.com">mail</a> <img src="_images/x.png">',
            "api.html": '<dt id="pkg.Thing">Thing</dt><a name="old-anchor"></a>'
            '<a href="index.html">home</a> <a href="api.html#old-anchor">old</a>',
            "_modules/pkg/mod.html": '<a href="../../api.html#pkg.Thing">[docs]</a>',
            "_images/x.png": "",
        },
    )
    assert broken(checker, root) == []


def test_a_viewcode_link_to_an_anchor_under_another_module_is_broken(
    checker: ModuleType, tmp_path: Path
) -> None:
    root = site(
        tmp_path,
        {
            "index.html": "",
            "api.html": '<dt id="pkg.mod.Holder">Holder</dt>',
            "_modules/pkg/mod.html": '<a class="viewcode-back" '
            'href="../../api.html#pkg.Holder">[docs]</a>',
        },
    )
    assert broken(checker, root) == [
        "_modules/pkg/mod.html: ../../api.html#pkg.Holder (no id 'pkg.Holder' in api.html)"
    ]


def test_missing_pages_files_and_same_page_anchors_are_broken(
    checker: ModuleType, tmp_path: Path
) -> None:
    root = site(
        tmp_path,
        {
            "index.html": '<a href="gone.html">gone</a> <a href="#nowhere">here</a>'
            '<img src="_images/missing.png"> <a href="../outside.html">out</a>',
        },
    )
    assert broken(checker, root) == [
        "index.html: gone.html (no such file)",
        "index.html: #nowhere (no id 'nowhere' in index.html)",
        "index.html: _images/missing.png (no such file)",
        "index.html: ../outside.html (outside the site)",
    ]


def test_the_script_exits_1_and_names_each_broken_link(tmp_path: Path) -> None:
    root = site(tmp_path, {"index.html": '<a href="api.html#x">x</a>', "api.html": ""})
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(root)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1
    assert result.stdout == "index.html: api.html#x (no id 'x' in api.html)\n"
    assert "1 broken internal link(s) in 2 page(s)" in result.stderr
