# SPDX-License-Identifier: MIT
"""kvtier.Error: a negative errno code from the library (or a refusal before calling it)."""

from __future__ import annotations

import errno as _errno
from typing import Optional

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


def refuse(detail: str, code: int = -_errno.EINVAL) -> Error:
    """An Error for an argument the Python layer refuses before calling C."""
    return Error(code, detail)


def check(rc: int, cache_handle: Optional[int] = None, what: str = "") -> int:
    """Raise Error for a negative return code, with kvt_last_error(cache) as the detail."""
    if rc >= 0:
        return rc
    raw = _abi.lib().kvt_last_error(cache_handle)
    detail = raw.decode("utf-8", "replace") if raw else ""
    entry = _abi.lib().kvt_last_error_entry(cache_handle) if cache_handle else -1
    if what and not detail:
        detail = what
    elif what:
        detail = "%s: %s" % (what, detail)
    raise Error(rc, detail, entry=entry if entry >= 0 else None)
