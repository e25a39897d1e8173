"""Every name each lock script uses is one it defines or one Redis gives it.

The scripts are composed from shared fragments (see django_redis_mutex.scripts).
A script that calls a helper its fragments do not define, a misspelled local,
or an assignment to a name nobody declared local is an error only when Redis
runs that line, and some lines run only on rare paths (a lapsed waiter met
while a slot migrates, a shared holder's lease ending mid-release). Here
Lua 5.1's own compiler (Redis embeds Lua 5.1) lists every global each script
reads and writes, whether or not any test reaches the line: a script writes
none, and reads only what Redis's scripting environment provides.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from django_redis_mutex import scripts

LUAC = shutil.which("luac5.1")
pytestmark = pytest.mark.skipif(
    LUAC is None, reason="needs luac5.1: install Debian's lua5.1 (apt-get install -y lua5.1)"
)

# What Redis's scripting environment gives a script (the standard Lua 5.1
# functions and libraries it loads, and its own).
REDIS_GLOBALS = frozenset(
    {
        "ARGV", "KEYS", "redis",
        "assert", "error", "ipairs", "next", "pairs", "pcall", "rawequal", "rawget",
        "rawset", "select", "setmetatable", "getmetatable", "tonumber", "tostring",
        "type", "unpack", "xpcall",
        "bit", "cjson", "cmsgpack", "math", "string", "struct", "table",
    }
)  # fmt: skip
GLOBAL_ACCESS = re.compile(r"\b(GETGLOBAL|SETGLOBAL)\b.*;\s*(\S+)\s*$")


def globals_of(source: str) -> tuple[set[str], set[str]]:
    """Return the globals ``source`` reads and those it writes, as luac5.1 compiles it."""
    listing = subprocess.run(
        [str(LUAC), "-p", "-l", "-"],
        input=source,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    read: set[str] = set()
    written: set[str] = set()
    for line in listing.splitlines():
        if match := GLOBAL_ACCESS.search(line):
            (read if match[1] == "GETGLOBAL" else written).add(match[2])
    return read, written


@pytest.mark.parametrize("script", scripts.SCRIPTS, ids=lambda script: script.name)
def test_a_script_reads_only_what_it_defines_or_redis_gives_and_writes_no_global(
    script: scripts.LuaScript,
) -> None:
    read, written = globals_of(script.source)
    assert not written, f"{script.name} assigns names not declared local: {sorted(written)}"
    assert read <= REDIS_GLOBALS, (
        f"{script.name} uses names it never defines: {sorted(read - REDIS_GLOBALS)}"
    )
    assert {"redis", "KEYS"} <= read  # the listing was read: every script calls Redis on a key


# A helper misspelled inside a function that only a rare path calls.
MISSPELLED = "local function f() return shared_recrod(KEYS[1]) end\nreturn f()"


@pytest.mark.parametrize(
    ("source", "read", "written"),
    [
        ("local a = 1\nreturn a", set(), set()),
        ("local a\na, b = 1, 2", set(), {"b"}),
        (MISSPELLED, {"shared_recrod", "KEYS"}, set()),
    ],
)
def test_the_listing_tells_a_missing_helper_and_a_stray_assignment(
    source: str, read: set[str], written: set[str]
) -> None:
    assert globals_of(source) == (read, written)
