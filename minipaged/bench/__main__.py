"""``python -m minipaged.bench NAME [options]``: run one benchmark script.

Each benchmark lives in ``minipaged/bench/NAME.py`` with a ``main(argv)``
and prints ratios against a baseline measured in the same run.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

import minipaged.bench as bench


def available() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(bench.__path__) if not m.name.startswith("_"))


def main(argv: list[str]) -> int:
    names = available()
    if not argv or argv[0] not in names:
        print(f"usage: python -m minipaged.bench {{{','.join(names)}}} [options]", file=sys.stderr)
        return 2
    module = importlib.import_module(f"minipaged.bench.{argv[0]}")
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
