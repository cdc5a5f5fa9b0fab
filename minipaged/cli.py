"""The command lines' argparse types and exits: a bad option is a usage error, an environment problem one line.

Every command line of the package (``serve``, ``train``, ``bench NAME``, ``checks``) follows one rule:
a bad value exits with status 2 and one line naming the option (argparse's ``prog: error: ...``);
a problem of the environment (a file or folder that is missing or cannot be written) exits with
status 1 and one line naming the cause. Never a traceback.
"""

from __future__ import annotations

import argparse
import math


def _integer(text: str) -> int:
    """``text`` as an int, or a usage error that quotes it."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def positive_int(text: str) -> int:
    """An argparse ``type``: an int >= 1, else a usage error that quotes the value."""
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def nonnegative_int(text: str) -> int:
    """An argparse ``type``: an int >= 0, else a usage error that quotes the value."""
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def port_number(text: str) -> int:
    """An argparse ``type``: a TCP port, an int in [1, 65535]."""
    value = nonnegative_int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in [1, 65535], got {value}")
    return value


def _number(text: str) -> float:
    """``text`` as a float, or a usage error that quotes it."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _number_where(text: str, ok, requirement: str) -> float:
    """``text`` as a float for which ``ok(value)`` holds, or a usage error saying what it ``must be``."""
    value = _number(text)
    if not ok(value):
        raise argparse.ArgumentTypeError(f"must be {requirement}, got {text}")
    return value


def positive_rate(text: str) -> float:
    """An argparse ``type``: a number > 0 (``inf`` allowed: every arrival at once), never NaN."""
    return _number_where(text, lambda v: not math.isnan(v) and v > 0, "a number > 0 (inf: all at once)")


def positive_finite(text: str) -> float:
    """An argparse ``type``: a finite number > 0 (not NaN, not inf)."""
    return _number_where(text, lambda v: math.isfinite(v) and v > 0, "a finite number > 0")


def proportion(text: str) -> float:
    """An argparse ``type``: a number in [0, 1]."""
    return _number_where(text, lambda v: 0 <= v <= 1, "in [0, 1]")


def fraction(text: str) -> float:
    """An argparse ``type``: a number in [0, 1)."""
    return _number_where(text, lambda v: 0 <= v < 1, "in [0, 1)")


def exit_environment(parser: argparse.ArgumentParser, error: BaseException):
    """Exit with status 1 and one line on stderr naming what the environment lacks (``prog: message``).

    Args:
        parser: the command line's parser (its ``prog`` starts the line).
        error: the error whose message names the cause (a missing file, an unwritable folder).
    """
    parser.exit(1, f"{parser.prog}: {' '.join(str(error).splitlines())}\n")
