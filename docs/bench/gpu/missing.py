"""Print the wheel files of docs/bench/gpu/wheels.txt whose package this machine's python3 cannot import."""

import importlib
import sys
from pathlib import Path

root = Path(__file__).resolve().parents[3]
for line in (root / "docs/bench/gpu/wheels.txt").read_text().splitlines():
    if not line.strip() or line.startswith("#"):
        continue
    module, wheel, version = line.split()
    try:
        importlib.import_module(module)
        print(f"have {module}", file=sys.stderr)
    except Exception:
        print(*sorted((root / ".whl").glob(f"{wheel}-{version}-*.whl")))
