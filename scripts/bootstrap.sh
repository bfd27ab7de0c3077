#!/usr/bin/env bash
# Create a virtual environment with torch 2.13.0, a megatron-core release and ascendspeed (editable,
# C++ operators built in place).
#
#   bash scripts/bootstrap.sh
#       .venv with the newest megatron-core this machine's Pythons allow: a Python 3.12 when one can be
#       found (python3.12 on PATH, or a 3.12 known to pyenv) with megatron-core 0.19.2, else Python 3 with
#       megatron-core 0.16.1 (megatron-core 0.17 and newer need Python >= 3.12).
#   VENV=<dir> MEGATRON_CORE=<version> [PYTHON=<python>] bash scripts/bootstrap.sh
#       any other environment, e.g. VENV=.venv-0.15 MEGATRON_CORE=0.15.3 PYTHON=python3.11.
#
# Idempotent and quick when nothing changed: packages are installed and the operators rebuilt only when
# setup.py, requirements.txt, ascendspeed/csrc, the Python or the megatron-core request change.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
MEGATRON_CORE=${MEGATRON_CORE:-}

# A Python 3.12 interpreter that really runs (a pyenv shim for an inactive version refuses), or nothing.
find_python312() {
  if command -v python3.12 >/dev/null 2>&1 && python3.12 -c "" >/dev/null 2>&1; then
    command -v python3.12
    return
  fi
  if command -v pyenv >/dev/null 2>&1; then
    local version
    version=$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.[0-9]+)?$' | sort -V | tail -n 1 || true)
    if [ -n "$version" ]; then
      PYENV_VERSION=$version pyenv which python3.12 2>/dev/null || true
    fi
  fi
}

python_minor() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])'; }

if [ -z "${PYTHON:-}" ]; then
  PYTHON=$(find_python312)
  PYTHON=${PYTHON:-python3}
fi
want_minor=$(python_minor "$PYTHON")
if [ -x "$VENV/bin/python" ] && [ "$(python_minor "$VENV/bin/python" 2>/dev/null || true)" != "$want_minor" ]; then
  echo "bootstrap: $VENV has another Python than $PYTHON ($want_minor); recreating it"
  rm -rf "$VENV"
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi

stamp=$VENV/.ascendspeed-build
want=$( (cat setup.py requirements.txt $(find ascendspeed/csrc -type f | sort); echo "$want_minor $MEGATRON_CORE") \
  | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! "$VENV/bin/python" -c "import ascendspeed._C" 2>/dev/null; then
  pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
  if [ -n "$MEGATRON_CORE" ]; then
    # requirements.txt without its megatron-core lines, plus the requested release.
    requirements=$(mktemp)
    trap 'rm -f "$requirements"' EXIT
    grep -v -E '^[[:space:]]*megatron-core' requirements.txt > "$requirements"
    "${pip[@]}" -r "$requirements" "megatron-core==$MEGATRON_CORE"
  else
    "${pip[@]}" -r requirements.txt
  fi
  "${pip[@]}" --no-build-isolation --no-deps -e .
  echo "$want" > "$stamp"
fi
