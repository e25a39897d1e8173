"""``sphinx.ext.viewcode``, with each "[docs]" link pointing at its object's own anchor.

Viewcode remembers one documenting module per source module: the module under
which the first object of that source was documented. Every "[docs]" link of
the source page is that name plus the object's, so an object documented under
another module gets a link to an anchor that does not exist. The package
re-exports part of ``django_redis_mutex.introspection`` and
``django_redis_mutex.semaphore`` (``HeldLock``, documented as
``django_redis_mutex.HeldLock``) and not the rest (``SharedHolder``, documented
as ``django_redis_mutex.introspection.SharedHolder``), so their source pages
linked to ``api.html#django_redis_mutex.SharedHolder``.

This extension loads viewcode, notes the anchor of every signature viewcode
gave a "[source]" link to, and writes the source pages through viewcode's own
code with each "[docs]" link set to that anchor. ``scripts/check_doc_links.py``
checks the built site, so a Sphinx release that writes those links differently
is noticed there.
"""

from __future__ import annotations

from collections.abc import Iterator, Set
from typing import Any

from docutils import nodes
from sphinx import addnodes
from sphinx.application import Sphinx
from sphinx.environment import BuildEnvironment
from sphinx.ext import viewcode

# docname -> {(source page, object name): anchor of its signature in docname}
Anchors = dict[str, dict[tuple[str, str], str]]


def _anchors(env: BuildEnvironment) -> Anchors:
    if not hasattr(env, "viewcode_backlink_anchors"):
        env.viewcode_backlink_anchors = {}  # type: ignore[attr-defined]
    anchors: Anchors = env.viewcode_backlink_anchors  # type: ignore[attr-defined]
    return anchors


def note_anchors(app: Sphinx, doctree: nodes.document) -> None:
    """After viewcode read a document: the anchor of each object it links to."""
    noted = _anchors(app.env).setdefault(app.env.docname, {})
    for anchor in doctree.findall(viewcode.viewcode_anchor):
        signature = anchor.parent
        if isinstance(signature, addnodes.desc_signature) and signature["ids"]:
            noted[(anchor["reftarget"], anchor["refid"])] = signature["ids"][0]


def purge(app: Sphinx, env: BuildEnvironment, docname: str) -> None:
    _anchors(env).pop(docname, None)


def merge(app: Sphinx, env: BuildEnvironment, docnames: Set[str], other: BuildEnvironment) -> None:
    theirs = _anchors(other)
    _anchors(env).update({docname: theirs[docname] for docname in docnames if docname in theirs})


def collect_pages(app: Sphinx) -> Iterator[tuple[str, dict[str, Any], str]]:
    """Viewcode's source pages, their "[docs]" links set to the anchors noted."""
    anchors = _anchors(app.env)
    modules = getattr(app.env, "_viewcode_modules", {})
    uri = app.builder.get_relative_uri
    for pagename, context, template in viewcode.collect_pages(app):
        entry = modules.get(pagename.removeprefix(viewcode.OUTPUT_DIRNAME + "/").replace("/", "."))
        if entry and "body" in context:
            _code, _tags, used, refname = entry
            body = context["body"]
            for name, docname in used.items():
                anchor = anchors.get(docname, {}).get((pagename, name))
                if anchor is None:
                    continue
                page = uri(pagename, docname)
                written = f'id="{name}">\n<a class="viewcode-back" href="{page}#{refname}.{name}">'
                meant = f'id="{name}">\n<a class="viewcode-back" href="{page}#{anchor}">'
                body = body.replace(written, meant)
            context["body"] = body
        yield pagename, context, template


def setup(app: Sphinx) -> dict[str, Any]:
    app.setup_extension("sphinx.ext.viewcode")
    for listener in list(app.events.listeners["html-collect-pages"]):
        if listener.handler is viewcode.collect_pages:
            app.disconnect(listener.id)
    app.connect("html-collect-pages", collect_pages)
    app.connect("doctree-read", note_anchors, priority=600)  # after viewcode's
    app.connect("env-purge-doc", purge)
    app.connect("env-merge-info", merge)
    return {"version": "1", "env_version": 1, "parallel_read_safe": True}
