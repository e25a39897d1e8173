"""Sphinx configuration of the django-redis-mutex documentation.

Build from the repository root with
``uv run --group docs sphinx-build -W -b html docs docs/_build/html``.
Autodoc imports the package, which needs configured Django settings: the
minimal ones in ``docs/django_settings.py``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path[:0] = [str(DOCS.parent), str(DOCS / "_ext"), str(DOCS)]
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "django_settings")

import django  # noqa: E402  (the path and settings module come first)

django.setup()

from django_redis_mutex import __version__  # noqa: E402

project = "django-redis-mutex"
author = "django-redis-mutex contributors"
copyright = "django-redis-mutex contributors"
release = __version__
version = __version__

extensions = [
    "sphinx.ext.autodoc",
    "viewcode_backlinks",  # sphinx.ext.viewcode, "[docs]" links to each object's anchor
    "benchmark_tables",
    "lua_scripts",  # .. lua-scripts::, from the scripts' contracts
]
exclude_patterns = ["_build", "_ext"]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
# The keyword arguments mutex(), Semaphore and semaphore() share with Mutex.
autodoc_type_aliases = {"LockOptions": "django_redis_mutex.conf.LockOptions"}
autodoc_default_options = {"members": True, "show-inheritance": True}
html_theme = "furo"
html_static_path = ["_static"]
html_css_files = ["screenshots.css"]

# Every cross-reference must resolve: a broken one fails the build (-W).
# The site is built offline (no intersphinx), so references to the standard
# library and to Django, which type hints make, have nowhere to point: they
# are listed here, each kind for the reason given. Everything of this app
# must resolve.
nitpicky = True
nitpick_ignore = [
    # The standard library, from type hints.
    ("py:class", "collections.abc.Callable"),
    ("py:class", "collections.abc.Iterable"),
    ("py:class", "collections.abc.Iterator"),
    ("py:class", "collections.abc.Sequence"),
    ("py:class", "datetime.datetime"),
    # Django, from type hints: the full paths, and the short names autodoc
    # leaves in the hint of MutexMiddleware's get_response.
    ("py:class", "django.db.models.base.Model"),
    ("py:class", "django.db.models.manager.Manager"),
    ("py:class", "django.db.models.query.QuerySet"),
    ("py:class", "django.http.request.HttpRequest"),
    ("py:class", "django.http.response.HttpResponse"),
    ("py:class", "HttpRequest"),
    ("py:class", "HttpResponse"),
    # MutexMiddleware's base class, named by autodoc; Django documents it
    # only in prose (its middleware upgrade notes).
    ("py:class", "django.utils.deprecation.MiddlewareMixin"),
    # The type variable of the decorated function in mutex() and
    # skip_if_locked(): a typing detail, not part of the API.
    ("py:class", "django_redis_mutex.decorators.F"),
    # What start() returns, passed through by testing.start_on_a_picked_port().
    ("py:class", "django_redis_mutex.testing.T"),
]
html_title = f"django-redis-mutex {release}"
