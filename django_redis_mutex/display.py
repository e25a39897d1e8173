"""How locks are shown to people: safe text and readable durations.

Lock names and labels are often built from request data. Wherever they are
shown to a person (the ``locks`` table, the 503 page, the admin), characters a
terminal acts on or that reorder text are shown escaped instead;
machine-readable output (JSON) keeps the exact value. Durations are written
one way everywhere (:func:`duration`); owners by ``str(Owner)``.
"""

from __future__ import annotations

import unicodedata

from django.utils.translation import gettext as _

__all__ = ["duration", "short_duration", "terminal_safe"]

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


def duration(seconds: float) -> str:
    """Return ``seconds`` as a person reads it: "4.2 s", "3 min 05 s", "2 h 10 min", "1 d 03 h"."""
    if seconds < 60:
        return _("%(seconds).1f s") % {"seconds": max(seconds, 0.0)}
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return _("%(minutes)d min %(seconds)02d s") % {"minutes": minutes, "seconds": secs}
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return _("%(hours)d h %(minutes)02d min") % {"hours": hours, "minutes": minutes}
    days, hours = divmod(hours, 24)
    return _("%(days)d d %(hours)02d h") % {"days": days, "hours": hours}


def short_duration(seconds: float | None) -> str:
    """Return a wait or hold time of the contention figures ("0.42 ms", "3.4 s"; "-": None).

    Percentiles of lock times run from well under a millisecond to minutes,
    so three significant digits, in milliseconds below a second.
    """
    if seconds is None:
        return "-"
    if seconds < 1:
        return _("%(ms)s ms") % {"ms": f"{seconds * 1000:.3g}"}
    if seconds < 60:
        return _("%(seconds)s s") % {"seconds": f"{seconds:.3g}"}
    return duration(seconds)
