"""Grade notebooks: ``python -m minipaged.checks grade NOTEBOOK [NOTEBOOK ...]``.

Each notebook is executed top to bottom in a fresh kernel (a cell that
raises stops nothing: later checks still run), then every check line it
printed is collected into one table. The exit status is 0 only if every
check passed.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from minipaged.checks import FAIL, PASS, TODO

_LINE = re.compile(rf"^\S+ ({PASS}|{FAIL}|{TODO})\s+(\S+?)(?::|$)", re.M)


def grade(path: Path, timeout: int = 600) -> list[tuple[str, str]]:
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, allow_errors=True, resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    results = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            text = out.get("text", "") if out.get("output_type") == "stream" else ""
            results += [(name, status) for status, name in _LINE.findall(text)]
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minipaged.checks")
    sub = parser.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("grade", help="execute notebooks and tabulate their checks")
    g.add_argument("notebooks", nargs="+", type=Path)
    args = parser.parse_args(argv)

    all_passed = True
    for path in args.notebooks:
        results = grade(path)
        passed = sum(s == PASS for _, s in results)
        print(f"{path}: {passed}/{len(results)} checks passed")
        for name, status in results:
            print(f"  {status:<20} {name}")
        all_passed &= bool(results) and passed == len(results)
    return 0 if all_passed else 1


if __name__ == "__main__":
    sys.exit(main())
