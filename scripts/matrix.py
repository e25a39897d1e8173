#!/usr/bin/env python3
"""Run the core test files against every supported Django / django-redis pair.

Usage (from the repository root)::

    uv run python scripts/matrix.py              # every leg
    uv run python scripts/matrix.py django42     # one leg (or several)
    uv run python scripts/matrix.py --list       # legs and the interpreter each would use
    uv run python scripts/matrix.py -- -x -k fence   # extra pytest arguments after --
    uv run python scripts/matrix.py django6 --python 3.13 --django "==6.0.*"   # one-off variant

Each leg gets its own virtualenv under ``build/matrix/<leg>`` (``uv venv``),
installs the project (editable) and its ``dev`` dependency group with the
leg's Django and django-redis pinned (``uv pip install``; packages come from
PyPI, never a Python download), then runs the core test files with pytest,
browser tests excluded. The tests start their own throwaway redis-server, as
the main suite does.

The environment passes through to the tests, so
``DJANGO_REDIS_MUTEX_TEST_BACKEND=django`` runs every leg on Django's own Redis
cache backend and ``REDIS_URL`` points them at an external server.

A leg whose Python cannot be found on this machine (``uv python find``, then
pyenv's versions, then ``pythonX.Y`` on PATH; never downloaded) is SKIPPED with
a message saying so; ``--require-all`` turns that into a failure. The exit
status is 1 when any leg failed, 0 otherwise. Only the standard library is
used, so ``python3 scripts/matrix.py`` works as well, given uv on PATH.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENVS = ROOT / "build" / "matrix"

# The files every leg runs: the engine, async (beside Django's own async
# views and settings), the Django surfaces (middleware, locks command,
# admin), and locks kept for database transactions (they follow Django's
# atomic blocks). Browser tests stay out, and so do the files whose outcome
# no Django version changes, such as real processes contending (the main
# suite and the leg on Django's Redis backend run them).
TEST_FILES = (
    "tests/test_smoke.py",
    "tests/test_api.py",
    "tests/test_async.py",
    "tests/test_middleware.py",
    "tests/test_locks_command.py",
    "tests/test_admin.py",
    "tests/test_transactions.py",
)

# A leg that runs longer than this is stopped and counted as failed.
LEG_TIMEOUT = 600


@dataclass(frozen=True)
class Leg:
    """One supported combination, and the Pythons it may run on, preferred first."""

    name: str
    django: str
    django_redis: str
    pythons: tuple[str, ...]
    note: str
    # Test files only this leg runs, for features of its Django version.
    extra_files: tuple[str, ...] = ()
    # Dependency groups installed beside ``dev`` (packages that need this Django).
    extra_groups: tuple[str, ...] = ()

    def requirements(self) -> list[str]:
        return [f"django{self.django}", f"django-redis{self.django_redis}"]


LEGS = (
    # The oldest supported pair on the oldest supported Python. django-redis 7
    # requires Django 5.2, so Django 4.2 runs with django-redis 6.
    Leg("django42", "==4.2.*", "==6.*", ("3.10", "3.11", "3.12"), "Django 4.2 LTS"),
    Leg("django52", "==5.2.*", "==7.*", ("3.11", "3.12", "3.13", "3.10"), "Django 5.2 LTS"),
    # Django 6 requires Python 3.12 or newer.
    Leg(
        "django6",
        ">=6.0,<7",
        "==7.*",
        ("3.12", "3.13", "3.14"),
        "newest Django 6.x",
        # django.tasks (@mutex on its tasks, ImmediateBackend and db_worker) is new in 6.0.
        extra_files=("tests/test_django_tasks.py",),
        extra_groups=("tasks",),
    ),
)


def _version_of(python: str) -> str | None:
    """Return "X.Y" of the interpreter at ``python``, or None if it does not run."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    try:
        out = subprocess.run(
            [python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=30,
            env=env,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _candidates(version: str) -> list[str]:
    """Return paths that may hold a CPython ``version``, most trusted first."""
    found: list[str] = []
    uv = subprocess.run(
        ["uv", "python", "find", "--system", "--no-project", version],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "UV_PYTHON_DOWNLOADS": "never"},
    )
    if uv.returncode == 0 and uv.stdout.strip():
        found.append(uv.stdout.strip())
    # pyenv's shims answer for the version .python-version selects only, so
    # look at the installed versions directly.
    pyenv_root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    found += sorted(
        glob.glob(f"{pyenv_root}/versions/{version}.*/bin/python{version}"), reverse=True
    )
    on_path = shutil.which(f"python{version}")
    if on_path:
        found.append(on_path)
    found += [f"/usr/bin/python{version}", f"/usr/local/bin/python{version}"]
    return found


def find_python(versions: tuple[str, ...]) -> tuple[str, str] | None:
    """Return (path, "X.Y") of the first preferred Python this machine has, else None."""
    for version in versions:
        for path in _candidates(version):
            if os.path.exists(path) and _version_of(path) == version:
                return path, version
    return None


def _run(cmd: list[str], env: dict[str, str], timeout: float | None = None) -> int:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT, env=env, timeout=timeout, check=False).returncode


def _leg_env(venv: Path) -> dict[str, str]:
    """Return the environment for a leg's pytest: its venv first, no uv project state."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "VIRTUAL_ENV",
            "PYTHONPATH",
            "PYTHONHOME",
            "UV_PROJECT_ENVIRONMENT",
            "DJANGO_SETTINGS_MODULE",
        )
    }
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["UV_PYTHON_DOWNLOADS"] = "never"
    return env


def run_leg(leg: Leg, pytest_args: list[str]) -> tuple[str, str]:
    """Build and test one leg; return (status, detail) with status PASSED/FAILED/SKIPPED."""
    found = find_python(leg.pythons)
    if found is None:
        return "SKIPPED", (
            f"no Python {' or '.join(leg.pythons)} on this machine ({leg.note} needs one); "
            "not downloaded (UV_PYTHON_DOWNLOADS=never), so this leg is untested here"
        )
    python, version = found
    venv = VENVS / leg.name
    env = _leg_env(venv)
    if _run(["uv", "venv", "--clear", "--quiet", "--python", python, str(venv)], env=env):
        return "FAILED", f"could not create a Python {version} virtualenv"
    install = [
        "uv",
        "pip",
        "install",
        "--quiet",
        "--python",
        str(venv / "bin" / "python"),
        "--editable",
        ".",
        "--group",
        "dev",
        *(option for group in leg.extra_groups for option in ("--group", group)),
        *leg.requirements(),
    ]
    if _run(install, env=env):
        return "FAILED", "could not install the project with " + " ".join(leg.requirements())
    versions = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import django, django_redis, redis; print(django.get_version(), "
            "'.'.join(map(str, django_redis.VERSION)), redis.__version__)",
        ],
        capture_output=True,
        text=True,
        check=False,
        env=env,
        cwd=ROOT,
    ).stdout.split()
    label = "Python {} Django {} django-redis {} redis-py {}".format(version, *versions)
    print(f"== {leg.name}: {label}", flush=True)
    pytest = [
        str(venv / "bin" / "python"),
        "-m",
        "pytest",
        *TEST_FILES,
        *leg.extra_files,
        "-m",
        "not browser",
        "-q",
        "-p",
        "no:cacheprovider",
        *pytest_args,
    ]
    try:
        code = _run(pytest, env=env, timeout=LEG_TIMEOUT)
    except subprocess.TimeoutExpired:
        return "FAILED", f"{label}: stopped after {LEG_TIMEOUT}s"
    return ("PASSED" if code == 0 else "FAILED"), f"{label} (pytest exit {code})"


def parse_args(
    parser: argparse.ArgumentParser, argv: list[str]
) -> tuple[argparse.Namespace, list[str]]:
    """Return the script's options and the arguments passed through to pytest.

    Everything after ``--`` goes to pytest as it is (argparse would take words
    there for legs); before it, options the script does not know go too.
    """
    if "--" in argv:
        cut = argv.index("--")
        argv, passed = argv[:cut], argv[cut + 1 :]
    else:
        passed = []
    args, unknown = parser.parse_known_args(argv)
    return args, unknown + passed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "legs",
        nargs="*",
        metavar="LEG",
        help="legs to run (default: all): " + ", ".join(x.name for x in LEGS),
    )
    parser.add_argument(
        "--list",
        action="store_true",
        help="print the legs and the Python each would use, then exit",
    )
    parser.add_argument(
        "--python", metavar="X.Y", help="run the chosen legs on this Python instead"
    )
    parser.add_argument("--django", metavar="SPEC", help='override the Django pin, e.g. "==6.0.*"')
    parser.add_argument(
        "--django-redis", metavar="SPEC", help='override the django-redis pin, e.g. "==5.4.*"'
    )
    parser.add_argument(
        "--require-all",
        action="store_true",
        help="fail, instead of skipping, a leg whose Python is missing",
    )
    args, pytest_args = parse_args(parser, sys.argv[1:] if argv is None else argv)
    by_name = {leg.name: leg for leg in LEGS}
    unknown = [name for name in args.legs if name not in by_name]
    if unknown:
        parser.error(f"unknown leg(s) {', '.join(unknown)}; choose from {', '.join(by_name)}")
    legs = [by_name[name] for name in args.legs] or list(LEGS)
    legs = [
        replace(
            leg,
            pythons=(args.python,) if args.python else leg.pythons,
            django=args.django or leg.django,
            django_redis=args.django_redis or leg.django_redis,
        )
        for leg in legs
    ]

    if args.list:
        for leg in legs:
            found = find_python(leg.pythons)
            where = f"Python {found[1]} at {found[0]}" if found else "no Python found: skipped"
            print(
                f"{leg.name:9} {leg.note}: django{leg.django} "
                f"django-redis{leg.django_redis}; {where}"
            )
        return 0

    results = []
    for leg in legs:
        started = time.monotonic()
        print(f"\n=== leg {leg.name}: {leg.note}", flush=True)
        status, detail = run_leg(leg, pytest_args)
        if status == "SKIPPED":
            print(f"SKIPPED {leg.name}: {detail}", flush=True)
        results.append((leg.name, status, time.monotonic() - started, detail))

    print("\n=== matrix summary")
    for name, status, seconds, detail in results:
        print(f"{status:8} {name:9} {seconds:6.1f}s  {detail}")
    failed = [r for r in results if r[1] == "FAILED" or (r[1] == "SKIPPED" and args.require_all)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
