"""The package's shape: the chapter -> module map holds, and the glossary names real identifiers.

CONTRIBUTING.md's chapter map and GLOSSARY.md are documents, so these tests
read them: a new module has to be placed in a chapter, an import of a later
chapter fails, and a glossary row cannot name an identifier the code lacks.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.package

ROOT = Path(__file__).resolve().parent.parent
SHARED = -1  # modules any chapter may import


def chapter_map() -> dict[str, int]:
    text = (ROOT / "CONTRIBUTING.md").read_text()
    table = text.split("<!-- chapter-map", 1)[1].split("<!-- end chapter-map", 1)[0]
    chapters = {}
    for chapter, modules in re.findall(r"^\| (shared|\d\d) \| (.+) \|$", table, re.M):
        for module in re.findall(r"`([\w.]+)`", modules):
            name = "minipaged" if module == "__init__" else f"minipaged.{module}"
            chapters[name] = SHARED if chapter == "shared" else int(chapter)
    return chapters


def package_modules() -> dict[str, Path]:
    """Every module of the package, by its import name (kernels/ installs as minipaged.kernels)."""
    found = {}
    for top, prefix in ((ROOT / "minipaged", "minipaged"), (ROOT / "kernels", "minipaged.kernels")):
        for path in top.rglob("*.py"):
            parts = path.relative_to(top).with_suffix("").parts
            if parts[-1] in ("__init__", "__main__"):
                parts = parts[:-1]
            found[".".join((prefix, *parts))] = path
    return found


def top_level_imports(path: Path, module: str) -> set[str]:
    """Modules imported when ``module`` is imported: not those imported inside a function."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    names = set()
    for node in tree.body:
        for sub in _walk_outside_functions(node):
            if isinstance(sub, ast.Import):
                names.update(alias.name for alias in sub.names)
            elif isinstance(sub, ast.ImportFrom):
                base = sub.module or ""
                if sub.level:
                    anchor = package.rsplit(".", sub.level - 1)[0] if sub.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                names.add(base)
                names.update(f"{base}.{alias.name}" for alias in sub.names)
    return names


def _walk_outside_functions(node):
    """``node`` and its descendants, skipping function bodies (a lazy import there is allowed)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        return
    yield node
    for child in ast.iter_child_nodes(node):
        yield from _walk_outside_functions(child)


# Entry points (checks, bench, the exercise generator) may use any chapter up to theirs.
ENTRY_POINTS = re.compile(r"minipaged\.(checks|bench|exercises)(\.|$)")


def test_every_module_has_a_chapter():
    chapters = chapter_map()
    missing = [m for m in package_modules() if m not in chapters and not ENTRY_POINTS.match(m)]
    assert not missing, f"add these modules to CONTRIBUTING.md's chapter map: {missing}"
    stale = [m for m in chapters if m not in package_modules()]
    assert not stale, f"CONTRIBUTING.md's chapter map names modules that don't exist: {stale}"


def test_no_module_imports_a_later_chapter():
    chapters = chapter_map()
    backward = []
    for module, path in package_modules().items():
        own = chapters.get(module)
        if own is None or own == SHARED:
            if own == SHARED:
                later = [i for i in top_level_imports(path, module) if chapters.get(i, SHARED) != SHARED]
                backward += [f"{module} (shared) imports {i}" for i in later]
            continue
        for imported in top_level_imports(path, module):
            theirs = chapters.get(imported)
            if theirs is not None and theirs > own:
                backward.append(f"{module} (ch{own:02d}) imports {imported} (ch{theirs:02d})")
    assert not backward, "imports that run backwards:\n" + "\n".join(sorted(backward))


def test_the_import_checker_sees_a_backward_import(tmp_path):
    # The checker itself must be able to fail: a module-level import is seen, a lazy one is not.
    path = tmp_path / "m.py"
    path.write_text("import minipaged.engine\nfrom . import scheduler\n\ndef f():\n    import minipaged.kernels\n")
    found = top_level_imports(path, "minipaged.m")
    assert {"minipaged.engine", "minipaged.scheduler"} <= found
    assert "minipaged.kernels" not in found


def glossary_identifiers() -> list[str]:
    names = []
    for line in (ROOT / "GLOSSARY.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and not set(cells[2]) <= set("-"):
            names += re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", cells[2])
    return names


def test_glossary_names_identifiers_the_code_uses():
    source = "\n".join(p.read_text() for p in package_modules().values())
    names = glossary_identifiers()
    assert len(names) > 40, "the glossary table was not parsed"
    missing = [n for n in names if not re.search(rf"\b{re.escape(n)}\b", source)]
    assert not missing, f"GLOSSARY.md names identifiers that the package does not have: {missing}"
