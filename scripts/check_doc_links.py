#!/usr/bin/env python3
"""Check that every internal link of the built documentation site arrives.

Usage (from the repository root, after the docs build)::

    uv run --group docs sphinx-build -W --keep-going -q -b html docs docs/_build/html
    uv run python scripts/check_doc_links.py              # docs/_build/html
    uv run python scripts/check_doc_links.py path/to/html

Every HTML page under the directory is read; each ``href`` and ``src`` that
stays inside the site (``page.html``, ``page.html#anchor``, ``#anchor``,
``_images/x.png``) must name a file that exists, and an anchor must be the
``id`` (or ``<a name>``) of an element of the page it names. Links with a
scheme (``https:``, ``mailto:``) or starting with ``//`` are left alone.
Sphinx's nitpicky mode catches references it cannot resolve while writing;
this catches the links it wrote anyway, such as viewcode's "[docs]" links to
an object documented under another name.

Each broken link is printed as ``page: href (why)``; the exit status is 1 when
any was found, 0 otherwise. Only the standard library is used.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

DEFAULT_SITE = Path(__file__).resolve().parent.parent / "docs" / "_build" / "html"
LINKING = {"href", "src"}


@dataclass(frozen=True)
class Broken:
    page: str
    link: str
    why: str

    def __str__(self) -> str:
        return f"{self.page}: {self.link} ({self.why})"


class _Page(HTMLParser):
    """The anchors a page defines and the links it makes."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.anchors: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value is None:
                continue
            if name == "id" or (tag == "a" and name == "name"):
                self.anchors.add(value)
            elif name in LINKING:
                self.links.append(value)

    handle_startendtag = handle_starttag


def _external(link: str) -> bool:
    parts = urlsplit(link)
    return bool(parts.scheme or parts.netloc or link.startswith("//"))


def _read(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    page.close()
    return page


def broken_links(site: Path) -> Iterator[Broken]:
    """Yield every internal link of the HTML pages under ``site`` that leads nowhere."""
    site = site.resolve()
    pages = {path.resolve(): _read(path) for path in sorted(site.rglob("*.html"))}
    for path, page in pages.items():
        name = path.relative_to(site).as_posix()
        for link in page.links:
            if _external(link):
                continue
            parts = urlsplit(link)
            target = (path.parent / unquote(parts.path)).resolve() if parts.path else path
            if not target.is_relative_to(site):
                yield Broken(name, link, "outside the site")
                continue
            if not target.exists():
                yield Broken(name, link, "no such file")
                continue
            if target.is_dir():
                target = target / "index.html"
                if target not in pages:
                    yield Broken(name, link, "a directory without index.html")
                    continue
            if not parts.fragment or target.suffix != ".html":
                continue
            anchor = unquote(parts.fragment)
            if anchor not in pages[target].anchors:
                yield Broken(name, link, f"no id {anchor!r} in {target.relative_to(site)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("site", nargs="?", type=Path, default=DEFAULT_SITE)
    options = parser.parse_args(argv)
    if not (options.site / "index.html").is_file():
        print(f"{options.site}: no index.html; build the docs first", file=sys.stderr)
        return 2
    broken = list(broken_links(options.site))
    for link in broken:
        print(link)
    pages = sum(1 for _ in options.site.rglob("*.html"))
    print(f"{len(broken)} broken internal link(s) in {pages} page(s)", file=sys.stderr)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
