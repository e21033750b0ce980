"""The linter is part of the suite: ruff with the rules configured in pyproject.toml, over the library and its tests."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    # ruff is in the test extra (pinned in constraints.txt); `python -m ruff` runs the one beside this interpreter
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "src", "tests"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
