#!/bin/bash
# Downloads the wheels of wheels.txt for the GPU machine (Python 3.12, x86-64 Linux) into .whl/ at the repository
# root (ignored by git; `carry` it to the device). Run here, where package registries are reachable.
set -euo pipefail
cd "$(dirname "$0")/../../.."
mkdir -p .whl
grep -q '^/.whl/$' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
grep -v '^#' docs/bench/gpu/wheels.txt | while read -r module wheel version; do
  [ -n "$module" ] || continue
  ls .whl/${wheel}-${version}-*.whl >/dev/null 2>&1 && continue
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl "${wheel}==${version}"
done
ls .whl
