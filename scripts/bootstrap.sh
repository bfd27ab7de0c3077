#!/usr/bin/env bash
# Create a virtual environment with torch 2.13.0, a megatron-core release and ascendspeed (editable,
# C++ operators built in place).
#
#   bash scripts/bootstrap.sh
#       .venv with the newest megatron-core this machine's Pythons allow: a Python 3.12 when one can be
#       found (python3.12 on PATH, or a 3.12 known to pyenv) with megatron-core 0.19.2, else Python 3.11
#       (else python3) with megatron-core 0.16.1 (megatron-core 0.17 and newer need Python >= 3.12).
#   VENV=<dir> MEGATRON_CORE=<version> [PYTHON=<python> | PYTHON_VERSION=<major.minor>] bash scripts/bootstrap.sh
#       any other environment, e.g. VENV=.venv-0.15 MEGATRON_CORE=0.15.3 PYTHON_VERSION=3.11
#       (PYTHON_VERSION is looked up on PATH, then in pyenv).
#
# Idempotent and quick when nothing changed: packages are installed and the operators rebuilt only when
# setup.py, requirements.txt, ascendspeed/csrc, the Python or the megatron-core request change.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
MEGATRON_CORE=${MEGATRON_CORE:-}

# An interpreter of Python <major.minor> that really runs (a pyenv shim of an inactive version refuses to),
# from PATH or else from pyenv (the newest installed patch release); nothing when there is none.
find_python() {
  local minor=$1 version
  if command -v "python$minor" >/dev/null 2>&1 && "python$minor" -c "" >/dev/null 2>&1; then
    command -v "python$minor"
    return
  fi
  if command -v pyenv >/dev/null 2>&1; then
    version=$(pyenv versions --bare 2>/dev/null | grep -E "^${minor//./\\.}(\.[0-9]+)?\$" | sort -V | tail -n 1 || true)
    if [ -n "$version" ]; then
      PYENV_VERSION=$version pyenv which "python$minor" 2>/dev/null || true
    fi
  fi
}

python_minor() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])'; }

if [ -z "${PYTHON:-}" ] && [ -n "${PYTHON_VERSION:-}" ]; then
  PYTHON=$(find_python "$PYTHON_VERSION")
  if [ -z "$PYTHON" ]; then
    echo "bootstrap: PYTHON_VERSION=$PYTHON_VERSION: no python$PYTHON_VERSION on PATH or in pyenv" >&2
    exit 1
  fi
fi
if [ -z "${PYTHON:-}" ]; then
  PYTHON=$(find_python 3.12)
  PYTHON=${PYTHON:-$(find_python 3.11)}
  PYTHON=${PYTHON:-python3}
fi
want_minor=$(python_minor "$PYTHON")
if [ -n "$MEGATRON_CORE" ] && [ "$(printf '%s\n' "$MEGATRON_CORE" 0.17 | sort -V | head -n 1)" = 0.17 ] \
  && [ "$(printf '%s\n' "$want_minor" 3.12 | sort -V | head -n 1)" != 3.12 ]; then
  echo "bootstrap: megatron-core $MEGATRON_CORE needs Python >= 3.12, $PYTHON is $want_minor;" \
    "set PYTHON or PYTHON_VERSION=3.12" >&2
  exit 1
fi
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
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! "$VENV/bin/python" -c "import torch, ascendspeed._C" 2>/dev/null; then
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
  # The operator library (ascendspeed/_C.abi3.so: libtorch and CPython's stable ABI) serves every Python with
  # the same torch release, its CPU and CUDA builds alike (their headers differ only in CUDA's): an environment
  # whose torch release and sources match the last build's reuses it instead of compiling it again.
  library_stamp=ascendspeed/.C-build
  library_want=$( (cat setup.py $(find ascendspeed/csrc -type f | sort); "$VENV/bin/python" -c \
    "import torch; print(torch.__version__.split('+')[0], torch.compiled_with_cxx11_abi())") \
    | sha256sum | cut -d' ' -f1)
  if [ -f ascendspeed/_C.abi3.so ] && [ "$(cat "$library_stamp" 2>/dev/null)" = "$library_want" ]; then
    ASCENDSPEED_BUILD_C=0 "${pip[@]}" --no-build-isolation --no-deps -e .
  else
    rm -f ascendspeed/_C.*.so "$library_stamp"  # a per-Python library would shadow the shared one
    "${pip[@]}" --no-build-isolation --no-deps -e .
    echo "$library_want" > "$library_stamp"
  fi
  "$VENV/bin/python" -c "import torch, ascendspeed._C" || {
    echo "bootstrap: ascendspeed._C does not import in $VENV" >&2
    exit 1
  }
  echo "$want" > "$stamp"
fi
