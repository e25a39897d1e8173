"""Show names and labels from untrusted input as text nobody can be fooled by.

Lock names and labels are often built from request data. Wherever they are
shown to a person (the ``locks`` table, the 503 page), characters a terminal
acts on or that reorder text are shown escaped instead; machine-readable output
(JSON) keeps the exact value.
"""

from __future__ import annotations

import unicodedata

__all__ = ["terminal_safe"]

# Characters a terminal acts on or reorders text by instead of showing: C0, DEL
# and C1 controls (Cc), format characters such as the bidi embeddings,
# overrides and isolates U+202A-U+202E and U+2066-U+2069 (Cf), line and
# paragraph separators, and lone surrogates.
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})


def _escape_char(char: str) -> str:
    if char == "\\":
        return "\\\\"
    if unicodedata.category(char) not in _UNSAFE_CATEGORIES:
        return char
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def terminal_safe(text: str) -> str:
    """Return ``text`` with every control, bidi and separator character escaped.

    Escapes read like Python's (``\\x1b``, ``\\u202e``); a backslash is doubled
    so that an escape in the output always means an escaped character, never a
    name that merely spells one. Printable text, including non-ASCII letters,
    is kept as it is.
    """
    if text.isprintable() and "\\" not in text:
        return text  # the common case: nothing to escape
    return "".join(_escape_char(char) for char in text)
