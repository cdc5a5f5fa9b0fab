"""Benchmarks: ``python -m minipaged.bench NAME``. Ratios against a same-run baseline, never timed tests.

The argparse ``type`` helpers below turn a bad option into a usage error, never a traceback.
"""

import argparse
import math


def positive_int(text: str) -> int:
    """An argparse ``type``: an int >= 1, else a usage error that quotes the value."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_rate(text: str) -> float:
    """An argparse ``type``: a number > 0 (``inf`` allowed: every arrival at once), never NaN."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if math.isnan(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0 (inf: all at once), got {text}")
    return value


def fraction(text: str) -> float:
    """An argparse ``type``: a number in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value
