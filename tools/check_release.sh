#!/usr/bin/env bash
# The release as a user gets it: build the sdist and the wheel (python -m build, isolated), install the wheel (not
# the checkout) into a fresh venv, and run `hpctp info` and the README's first look on 2 ranks from a directory
# outside the checkout, so a module or data file missing from the wheel fails here. Also checks that the wheel's
# version is hpctp.__version__ and the C header's. Run by .ci/run; about 2 minutes (the venv's torch install).
#
# Usage: tools/check_release.sh   (from anywhere; uses .venv's python for the build, python3 for the fresh venv)
# Environment: RELEASE_DIR=DIR    where the dist/ files and the fresh venv go (default build/release)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DIR=${RELEASE_DIR:-$ROOT/build/release}
rm -rf "$DIR" build/lib build/bdist.*  # (setuptools' staging folders: a stale file there would enter the wheel)
mkdir -p "$DIR"

echo "=== release: python -m build (sdist + wheel) ==="
.venv/bin/python -m pip install -q -c constraints.txt build
.venv/bin/python -m build -o "$DIR/dist" . > "$DIR/build.log" 2>&1 || { tail -n 40 "$DIR/build.log"; exit 1; }
wheel=$(ls "$DIR"/dist/hpctp-*-py3-none-any.whl)
sdist=$(ls "$DIR"/dist/hpctp-*.tar.gz)
version=$(basename "$wheel" | cut -d- -f2)
echo "built $(basename "$sdist") and $(basename "$wheel")"
tar tzf "$sdist" > "$DIR/sdist.txt"
for f in LICENSE CHANGELOG.md README.md CMakeLists.txt capi/hpctp.h capi/hpctp.f90 hpctp/py.typed hpctp/machine/published/h100-ndr.toml; do
  grep -qx "hpctp-$version/$f" "$DIR/sdist.txt" || { echo "the sdist lacks $f" >&2; exit 1; }
done

echo "=== release: the wheel in a fresh venv ==="
python3 -m venv "$DIR/venv"
"$DIR/venv/bin/python" -m pip install -q --upgrade pip
"$DIR/venv/bin/python" -m pip install -q -c constraints.txt "$wheel[mpich]"

# from outside the checkout: the wheel's hpctp, not the source tree's
away=$(mktemp -d)
trap 'rm -rf "$away"' EXIT
cp examples/first_look.py "$away/"
cd "$away"
"$DIR/venv/bin/python" - "$version" "$ROOT/capi/hpctp.h" <<'PY'
import re, sys
from pathlib import Path

import hpctp
import hpctp.machine
import hpctp.perf

version, header = sys.argv[1], Path(sys.argv[2]).read_text()
where = Path(hpctp.__file__).resolve()
if "site-packages" not in where.parts:
    raise SystemExit(f"hpctp imported from {where}, not from the installed wheel")
macros = tuple(int(re.search(rf"#define HPCTP_VERSION_{p} (\d+)", header).group(1)) for p in ("MAJOR", "MINOR", "PATCH"))
if not hpctp.__version__ == version == ".".join(map(str, macros)):
    raise SystemExit(f"versions differ: hpctp.__version__ {hpctp.__version__}, wheel {version}, capi/hpctp.h {macros}")
# the package data: the published machine files (hpctp.machine's, also hpctp.perf's)
machines = hpctp.machine.published_machines()
if not machines or hpctp.perf.published_machines() != machines:
    raise SystemExit("the wheel has no published machine files (hpctp/machine/published/*.toml)")
for name in machines:
    hpctp.machine.load_machine(name)
hpctp.machine.default_machine()
print(f"hpctp {hpctp.__version__} from {where.parent}; machine files: {', '.join(machines)}")
PY
MPIR_CVAR_ENABLE_HEAVY_YIELD=1 OMP_NUM_THREADS=1 timeout 300 "$DIR/venv/bin/mpiexec" -n 2 "$DIR/venv/bin/python" -m hpctp info
MPIR_CVAR_ENABLE_HEAVY_YIELD=1 OMP_NUM_THREADS=1 timeout 300 "$DIR/venv/bin/mpiexec" -n 2 "$DIR/venv/bin/python" first_look.py
echo "=== release: hpctp $version installs and runs from its wheel ==="
