# SPDX-License-Identifier: MIT
"""kvtier.Error: a negative errno code from the library (or a refusal before calling it)."""

from __future__ import annotations

import errno as _errno
import numbers
from typing import Any, Optional

from . import _abi


# the names kvtier.h uses where Linux has two for one value
_NAMES = {_errno.EOPNOTSUPP: "EOPNOTSUPP", _errno.EAGAIN: "EAGAIN"}


class Error(Exception):
    """A kvtier failure.

    Attributes:
        code: the negative errno value the C function returned (or would return), e.g. -22.
        errno: its positive value, e.g. 22.
        name: the errno name, e.g. "EINVAL".
        strerror: kvt_strerror(code), the library's text for the code.
        detail: kvt_last_error's text (which argument, which value, which limit), or the Python
            layer's own detail for a refusal made before calling C.
        entry: kvt_last_error_entry: the index into the failed call's batch (`seqs`) of the
            sequence the error concerns, or None; the call changed nothing, so the caller may
            retry without that sequence.
    """

    def __init__(self, code: int, detail: str = "", strerror: Optional[str] = None,
                 entry: Optional[int] = None):
        self.code = int(code)
        self.entry = entry
        self.errno = -self.code
        self.name = _NAMES.get(self.errno) or _errno.errorcode.get(self.errno, "E?%d" % self.errno)
        if strerror is None:
            strerror = _abi.lib().kvt_strerror(self.code).decode("utf-8", "replace")
        self.strerror = strerror
        self.detail = detail
        text = "%s (%s, %d)" % (strerror, self.name, self.code)
        super().__init__(text + (": " + detail if detail else ""))


U32_MAX = (1 << 32) - 1
U64_MAX = (1 << 64) - 1


def refuse(detail: str, code: int = -_errno.EINVAL, entry: Optional[int] = None) -> Error:
    """An Error for an argument the Python layer refuses before calling C; `entry` as
    Error.entry (the index in a batch of the sequence refused)."""
    return Error(code, detail, entry=entry)


def whole(name: str, value: Any, limit: int, low: int = 0) -> int:
    """`value` as an int in [low, limit] (the C parameter's range: ctypes would wrap a larger
    one silently); else Error -EINVAL naming the value and the range. Refuses bools, floats and
    other non-integers; numpy's integers are accepted."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise refuse("%s = %r: want an int in [%d, %d]" % (name, value, low, limit))
    v = int(value)
    if not low <= v <= limit:
        raise refuse("%s = %d: want an int in [%d, %d]" % (name, v, low, limit))
    return v


def check(rc: int, cache_handle: Optional[int] = None, what: str = "") -> int:
    """Raise Error for a negative return code, with kvt_last_error(cache) as the detail."""
    if rc >= 0:
        return rc
    raw = _abi.lib().kvt_last_error(cache_handle)
    detail = raw.decode("utf-8", "replace") if raw else ""
    entry = _abi.lib().kvt_last_error_entry(cache_handle) if cache_handle else -1
    if what and not detail:
        detail = what
    elif what and not detail.startswith(what):  # C names its function itself
        detail = "%s: %s" % (what, detail)
    raise Error(rc, detail, entry=entry if entry >= 0 else None)
