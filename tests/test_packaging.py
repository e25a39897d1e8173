"""What a user gets from ``pip install django-redis-mutex``.

The wheel and sdist are built from this tree with ``uv build`` (hatchling comes
from PyPI), and the wheel is installed into a fresh virtualenv with ``uv pip``,
outside this repository: a template, static file or migration left out of the
package fails here, not in a user's project. The installed copy then runs in a
throwaway Django project made in a temporary directory, against the suite's
Redis.
"""

from __future__ import annotations

import importlib.metadata
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest
from django.core.management import call_command

import django_redis_mutex

from .helpers import ROOT

PACKAGE = ROOT / "django_redis_mutex"
PYPROJECT = ROOT / "pyproject.toml"

# Files a Django app cannot work without, named so a rename shows up here.
REQUIRED_FILES = (
    "django_redis_mutex/py.typed",
    "django_redis_mutex/templates/django_redis_mutex/503.html",
    "django_redis_mutex/templates/django_redis_mutex/admin/locks.html",
    "django_redis_mutex/templates/django_redis_mutex/admin/release.html",
    "django_redis_mutex/templates/django_redis_mutex/admin/page.html",
    "django_redis_mutex/templates/django_redis_mutex/panels/head.html",
    "django_redis_mutex/static/django_redis_mutex/admin/locks.js",
    "django_redis_mutex/migrations/__init__.py",
    "django_redis_mutex/migrations/0001_initial.py",
    "django_redis_mutex/migrations/0002_semaphore.py",
    "django_redis_mutex/migrations/_unmanaged.py",
    "django_redis_mutex/management/__init__.py",
    "django_redis_mutex/management/commands/__init__.py",
    "django_redis_mutex/management/commands/locks.py",
)

# Failures of uv that mean "no network", not "the package is broken".
OFFLINE_HINTS = (
    "failed to fetch",
    "failed to download",
    "dns error",
    "connection refused",
    "network is unreachable",
    "error sending request",
    "offline",
)


def _uv() -> str:
    uv = os.environ.get("UV") or shutil.which("uv")
    if not uv:
        pytest.skip("uv is not on PATH, so the package cannot be built here (pip install uv).")
    return uv


def _uv_env() -> dict[str, str]:
    """Return an environment for uv commands that never touches this project's .venv."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("VIRTUAL_ENV", "UV_PROJECT_ENVIRONMENT", "PYTHONPATH")
    }
    env["UV_PYTHON_DOWNLOADS"] = "never"
    return env


def _run_uv(*args: str, what: str) -> None:
    """Run uv; skip when PyPI cannot be reached, fail on any other error."""
    done = subprocess.run(
        [_uv(), *args],
        env=_uv_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode == 0:
        return
    if any(hint in done.stderr.lower() for hint in OFFLINE_HINTS):
        pytest.skip(f"Cannot {what} without PyPI: {done.stderr.strip()[-400:]}")
    pytest.fail(f"Could not {what} (uv {' '.join(args)}):\n{done.stderr}")


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the sdist, and the wheel from that sdist, as a release would."""
    out = tmp_path_factory.mktemp("dist")
    _run_uv("build", "--out-dir", str(out), str(ROOT), what="build the package")
    return out


@pytest.fixture(scope="module")
def wheel(dist: Path) -> Path:
    (found,) = dist.glob("django_redis_mutex-*.whl")
    return found


@pytest.fixture(scope="module")
def sdist(dist: Path) -> Path:
    (found,) = dist.glob("django_redis_mutex-*.tar.gz")
    return found


def _wheel_names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return set(archive.namelist())


def _package_data() -> set[str]:
    """Return every template and static file of the source tree, as wheel paths."""
    return {
        path.relative_to(ROOT).as_posix()
        for folder in ("templates", "static", "locale")
        for path in (PACKAGE / folder).rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }


def test_wheel_ships_every_file_the_app_needs(wheel: Path) -> None:
    missing = sorted(set(REQUIRED_FILES) - _wheel_names(wheel))
    assert missing == []


def test_wheel_ships_every_template_and_static_file_of_the_tree(wheel: Path) -> None:
    assert _package_data() <= _wheel_names(wheel)


def test_wheel_holds_only_the_package_and_no_bytecode(wheel: Path) -> None:
    names = _wheel_names(wheel)
    top_level = {name.split("/")[0] for name in names}
    assert {name for name in top_level if not name.endswith(".dist-info")} == {"django_redis_mutex"}
    assert [n for n in names if "__pycache__" in n or n.endswith(".pyc")] == []


def test_wheel_metadata_declares_dependencies_python_and_typing(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        (metadata_name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = archive.read(metadata_name).decode()
    requires = {
        line.split(":", 1)[1].strip().split(">")[0].split(";")[0].strip()
        for line in metadata.splitlines()
        if line.startswith("Requires-Dist:")
    }
    assert {"django", "django-redis", "redis"} <= requires
    python = re.search(r'^requires-python = "([^"]+)"', PYPROJECT.read_text(), re.MULTILINE)
    assert python is not None
    assert f"Requires-Python: {python.group(1)}" in metadata.splitlines()
    assert "Classifier: Typing :: Typed" in metadata.splitlines()


def test_sdist_carries_license_readme_changelog_and_tests(sdist: Path) -> None:
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    expected = {
        "LICENSE",
        "README.rst",
        "CHANGELOG.md",
        "pyproject.toml",
        "tests/conftest.py",
        "tests/settings.py",
        *REQUIRED_FILES,
    }
    assert sorted(expected - names) == []


# -- the wheel installed in a fresh virtualenv, used by a throwaway project ----

SETTINGS = """\
import os

SECRET_KEY = "throwaway-project-not-secret"
DEBUG = False
USE_TZ = True
ALLOWED_HOSTS = ["*"]
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_redis_mutex",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django_redis_mutex.middleware.MutexMiddleware",
]
ROOT_URLCONF = "throwaway.urls"
TEMPLATES = [{
    "BACKEND": "django.template.backends.django.DjangoTemplates",
    "APP_DIRS": True,
    "OPTIONS": {"context_processors": [
        "django.template.context_processors.request",
        "django.contrib.auth.context_processors.auth",
        "django.contrib.messages.context_processors.messages",
    ]},
}]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3",
                         "NAME": os.path.join(os.path.dirname(__file__), "db.sqlite3")}}
CACHES = {
    "default": {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": os.environ["THROWAWAY_REDIS_URL"],
        "KEY_PREFIX": "throwaway",
        "MUTEX": {"PREFIX": os.environ["THROWAWAY_MUTEX_PREFIX"], "TTL": 10},
    },
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
STATIC_URL = "static/"
"""

URLS = """\
from django.contrib import admin
from django.urls import path

urlpatterns = [path("admin/", admin.site.urls)]
"""


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Return the python of a fresh virtualenv holding only the wheel and its dependencies.

    Django, django-redis and redis-py are pinned to the versions this suite runs
    with, so the check is repeatable and mostly served from uv's cache.
    """
    venv = tmp_path_factory.mktemp("venv") / "env"
    _run_uv("venv", "--quiet", "--python", sys.executable, str(venv), what="create a virtualenv")
    python = venv / "bin" / "python"
    pins = [
        f"{name}=={importlib.metadata.version(name)}"
        for name in ("django", "django-redis", "redis", "asgiref")
    ]
    constraints = venv.parent / "constraints.txt"
    constraints.write_text("\n".join(pins) + "\n")
    _run_uv(
        "pip",
        "install",
        "--quiet",
        "--python",
        str(python),
        "--constraints",
        str(constraints),
        str(wheel),
        what="install the wheel",
    )
    return python


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """Make a throwaway Django project that knows nothing of this repository."""
    package = tmp_path / "throwaway"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "settings.py").write_text(SETTINGS)
    (package / "urls.py").write_text(URLS)
    return tmp_path


def _django(
    python: Path, project: Path, redis_url: str, prefix: str, *args: str
) -> subprocess.CompletedProcess[str]:
    """Run ``python <args>`` in the throwaway project, never seeing this repository."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("DJANGO", "PYTHON", "VIRTUAL_ENV"))
    }
    env.update(
        DJANGO_SETTINGS_MODULE="throwaway.settings",
        PYTHONPATH=str(project),
        THROWAWAY_REDIS_URL=redis_url,
        THROWAWAY_MUTEX_PREFIX=prefix,
    )
    return subprocess.run(
        [str(python), *args],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_installed_app_passes_django_check(
    installed: Path, project: Path, redis_url: str, mutex_prefix: str
) -> None:
    done = _django(
        installed,
        project,
        redis_url,
        mutex_prefix,
        "-m",
        "django",
        "check",
        "--fail-level",
        "WARNING",
    )
    assert done.returncode == 0, done.stderr
    assert "System check identified no issues" in done.stdout


def test_installed_package_is_imported_from_the_virtualenv(
    installed: Path, project: Path, redis_url: str, mutex_prefix: str
) -> None:
    code = textwrap.dedent("""\
        import django_redis_mutex as m
        print(m.__file__)
        print(" ".join(name for name in m.__all__ if hasattr(m, name)))
    """)
    done = _django(installed, project, redis_url, mutex_prefix, "-c", code)
    assert done.returncode == 0, done.stderr
    location, names = done.stdout.splitlines()
    assert Path(location).is_relative_to(installed.parent.parent)
    assert names.split() == list(django_redis_mutex.__all__)


def test_installed_public_names_take_a_lock_on_redis(
    installed: Path, project: Path, redis_url: str, mutex_prefix: str
) -> None:
    code = textwrap.dedent("""\
        import django
        django.setup()
        from django_redis_mutex import held_locks, mutex
        with mutex("packaging:check", label="from the wheel") as lock:
            held = held_locks()
            print(lock.fence > 0, [(h.name, h.owner.label) for h in held])
        print(held_locks())
    """)
    done = _django(installed, project, redis_url, mutex_prefix, "-c", code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "True [('packaging:check', 'from the wheel')]",
        "[]",
    ]


def test_installed_app_migrates_and_creates_its_permissions(
    installed: Path, project: Path, redis_url: str, mutex_prefix: str
) -> None:
    migrate = _django(
        installed,
        project,
        redis_url,
        mutex_prefix,
        "-m",
        "django",
        "migrate",
        "--noinput",
        "-v",
        "0",
    )
    assert migrate.returncode == 0, migrate.stderr
    code = textwrap.dedent("""\
        import django
        django.setup()
        from django.contrib.auth.models import Permission
        print(sorted(Permission.objects.filter(content_type__app_label="django_redis_mutex")
                     .values_list("codename", flat=True)))
    """)
    done = _django(installed, project, redis_url, mutex_prefix, "-c", code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['release_lock', 'reset_semaphore', 'view_lock']"


def test_installed_app_finds_its_templates_and_static_files(
    installed: Path, project: Path, redis_url: str, mutex_prefix: str
) -> None:
    code = textwrap.dedent("""\
        import django
        django.setup()
        from django.contrib.staticfiles import finders
        from django.template.loader import get_template
        for name in ("django_redis_mutex/503.html", "django_redis_mutex/admin/locks.html",
                     "django_redis_mutex/admin/release.html"):
            print(get_template(name).origin.name)
        print(finders.find("django_redis_mutex/admin/locks.js"))
    """)
    done = _django(installed, project, redis_url, mutex_prefix, "-c", code)
    assert done.returncode == 0, done.stderr
    found = done.stdout.splitlines()
    assert len(found) == 4
    assert [p for p in found if not Path(p).is_relative_to(installed.parent.parent)] == []


def test_installed_locks_command_lists_a_held_lock(
    installed: Path, project: Path, redis_url: str, mutex_prefix: str
) -> None:
    code = textwrap.dedent("""\
        import django
        django.setup()
        from django.core.management import call_command
        from django_redis_mutex import mutex
        with mutex("packaging:command"):
            call_command("locks", "--json")
    """)
    done = _django(installed, project, redis_url, mutex_prefix, "-c", code)
    assert done.returncode == 0, done.stderr
    assert [lock["name"] for lock in json.loads(done.stdout)] == ["packaging:command"]


def test_the_package_modules_import_each_other_without_cycles() -> None:
    """Each module's imports of the package's own modules (lazy ones too) form no cycle.

    A cycle hidden behind a function-level import still ties two modules
    together: neither can be understood, tested or changed alone.
    """
    import ast

    package = Path(__file__).resolve().parent.parent / "django_redis_mutex"
    modules = {path.stem: path for path in package.glob("*.py") if path.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    imported.add(node.module.split(".")[0])
                else:
                    imported.update(alias.name for alias in node.names)
        graph[name] = {other for other in imported if other in modules and other != name}

    def cycle_from(start: str) -> list[str] | None:
        stack = [(start, [start])]
        while stack:
            node, trail = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    return [*trail, start]
                if nxt not in trail:
                    stack.append((nxt, [*trail, nxt]))
        return None

    cycles = [found for name in sorted(graph) if (found := cycle_from(name))]
    assert cycles == [], f"import cycles between package modules: {cycles}"


def test_the_contributing_page_names_every_module_of_the_package() -> None:
    """Its module map is where a newcomer finds the engine, the glue and the admin."""
    root = Path(__file__).resolve().parent.parent
    page = (root / "docs" / "contributing.rst").read_text()
    layout = page[page.index("Layout\n") :]
    package = root / "django_redis_mutex"
    modules = [
        path.relative_to(package).as_posix()
        for path in package.rglob("*.py")
        if path.name != "__init__.py" and "migrations" not in path.parts
    ]
    missing = [
        module
        for module in modules
        if f"``{module}``" not in layout and f"``{Path(module).name}``" not in layout
    ]
    assert missing == []


@pytest.mark.django_db
def test_the_migrations_build_exactly_the_models_declared() -> None:
    """The migrations share their one shape (migrations/_unmanaged.py): they must still match."""
    out = io.StringIO()
    call_command("makemigrations", "django_redis_mutex", check=True, dry_run=True, stdout=out)
    assert "No changes detected" in out.getvalue()
