"""DESIGN.md §4 names the modules: every path it names exists, and every package and top-level module is named."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "titans"


def named_paths() -> list[str]:
    """The first word of each indented line of DESIGN.md's layout section: paths under src/titans."""
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    section = text.split("## 4. Layout", 1)[1].split("\n## ", 1)[0]
    return [m.group(1) for m in re.finditer(r"^ {4}(\S+)\s", section, flags=re.M)]


def test_every_module_the_layout_names_exists():
    paths = named_paths()
    assert len(paths) > 20
    missing = [p for p in paths if not (PACKAGE / p).exists() or (p.endswith("/") != (PACKAGE / p).is_dir())]
    assert not missing, f"DESIGN.md §4 names modules that are not in src/titans: {missing}"


def test_every_package_and_top_level_module_is_named():
    named = set(named_paths())
    packages = {f"{p.parent.relative_to(PACKAGE).as_posix()}/" for p in PACKAGE.glob("*/*.py")}  # bench/: no __init__
    modules = {p.name for p in PACKAGE.glob("*.py")}
    unnamed = sorted((packages | modules) - named)
    assert not unnamed, f"DESIGN.md §4 does not name: {unnamed}"
