"""``scripts/matrix.py`` passes extra arguments through to each leg's pytest."""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys

import pytest

from .helpers import ROOT


def listed(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the script with ``--list``: it parses everything, then builds nothing."""
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "matrix.py"), "--list", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "args",
    [
        ["django42", "--", "-x", "-k", "fence"],
        ["--", "--maxfail=1", "tests/test_api.py"],
        ["django42", "-x"],
    ],
    ids=["after-dashes", "dashes-only", "unknown-option"],
)
def test_pytest_arguments_are_not_taken_for_legs(args: list[str]) -> None:
    result = listed(*args)
    assert result.returncode == 0, result.stderr
    assert "unknown leg" not in result.stderr


def test_pytest_gets_every_argument_after_the_dashes_and_unknown_options(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = importlib.util.spec_from_file_location("matrix", ROOT / "scripts" / "matrix.py")
    assert spec is not None and spec.loader is not None
    matrix = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "matrix", matrix)  # its dataclasses look themselves up
    spec.loader.exec_module(matrix)
    parser = argparse.ArgumentParser()
    parser.add_argument("legs", nargs="*")
    args, passed = matrix.parse_args(parser, ["django42", "-q", "--", "-x", "-k", "fence"])
    assert args.legs == ["django42"]
    assert passed == ["-q", "-x", "-k", "fence"]
