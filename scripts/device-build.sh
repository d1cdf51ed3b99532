#!/usr/bin/env bash
# The hot modules (boundless/compiled.py) compiled for the GPU machine's Python (3.12) into .device-build/, which git
# ignores and a device run carries (the device tool's run with carry [".device-build"]): its checks then time the
# engine's host work as `make` installs it, not from source (the machine has no mypy). A build made with any 3.12
# loads in the machine's 3.12.3: the build's key is the ABI's. Needs a Python 3.12 here (PYTHON312, else python3.12
# on the PATH or pyenv's) and PyPI for mypy.
set -euo pipefail
py=
for candidate in ${PYTHON312:-} python3.12 ~/.pyenv/versions/3.12*/bin/python3.12; do  # (the first that runs 3.12)
    if "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
        py=$candidate
        break
    fi
done
[ -n "$py" ] || { echo "device-build: no Python 3.12 here (set PYTHON312)" >&2; exit 1; }
venv=${TMPDIR:-/tmp}/boundless-device-py312
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
"$venv/bin/pip" install -q "mypy==2.4.1" mypy-extensions setuptools
BOUNDLESS_CACHE_DIR=$PWD/.device-build "$venv/bin/python" boundless/compiled.py --strict
grep -qx '/.device-build/' .git/info/exclude || echo '/.device-build/' >>.git/info/exclude
