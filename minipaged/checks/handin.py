"""What a learner hands in, read and printed safely: the grader's and the copy flagger's one reader (issue 41).

A handed-in file (a notebook, a piece file) is opened only if it is a regular file: a symbolic link (to a
classmate's file, to ``/dev/zero``), a FIFO, a device, a socket or a folder is refused without blocking, as
are a file past a size cap and a read that stalls. Anything a learner named or wrote is printed through
:func:`shown`, so no name or message can drive the terminal.
"""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

MAX_FILE = 64 * 2**20  # bytes of a handed-in file (a notebook, a piece file) the grader reads at most
READ_TIMEOUT = 10.0  # seconds a handed-in file gets to be read
_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"))


class GradeError(ValueError):
    """A path that cannot be graded: missing, not a notebook, not a regular file, no exercise for its chapter, or
    a duplicate."""


def shown(text) -> str:
    """``text`` safe to print on a terminal or in a CSV cell: every character that is not printable (a control
    code such as the escape that starts a terminal sequence, a newline, a bidirectional override) is written as
    its Python escape, ``\\x1b``, so no name or message can repaint or forge another line."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in str(text))


def _refusal(path: Path, limit: int) -> tuple[bytes | None, str]:
    """``(the file's bytes, "")``, or ``(None, why it is not read)``; opened with ``O_NOFOLLOW | O_NONBLOCK`` so
    that neither a link nor a FIFO is followed or waited on."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:  # ELOOP: a symbolic link
        return None, "a symbolic link" if path.is_symlink() else (exc.strerror or str(exc))
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            return None, next((name for test, name in _KINDS if test(mode)), "not a regular file")
        data = f.read(limit + 1)
    if len(data) > limit:
        return None, f"more than the {limit:,} bytes a handed-in file may have"
    return data, ""


def read_handed_in(path: Path, limit: int = MAX_FILE, timeout: float = READ_TIMEOUT) -> bytes:
    """The bytes of a handed-in file, read only if it is a regular file of at most ``limit`` bytes, within
    ``timeout`` seconds (a stalled network mount is given up); else :class:`GradeError` saying why.

    Args:
        path: the file, as the learner handed it in.
        limit: the most bytes it may have.
        timeout: the seconds the read may take.
    """
    box: list[tuple[bytes | None, str]] = []
    reader = threading.Thread(target=lambda: box.append(_refusal(path, limit)), daemon=True)
    reader.start()
    reader.join(timeout)
    if not box:
        raise GradeError(f"{shown(path)}: could not be read within {timeout:g} s")
    data, why = box[0]
    if data is None:
        raise GradeError(f"{shown(path)}: {why}, not a file the grader reads")
    return data
