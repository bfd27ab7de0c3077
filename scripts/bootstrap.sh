#!/usr/bin/env bash
# Create .venv with the pinned torch (CPU wheel) and megatron-core, and build ascendspeed's C++ ops.
# Idempotent and quick when nothing changed: the build is redone only when setup.py or csrc/ change.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.ascendspeed-build
want=$(cat setup.py requirements.txt $(find ascendspeed/csrc -type f | sort) | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! .venv/bin/python -c "import ascendspeed._C" 2>/dev/null; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -r requirements.txt
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e .
  echo "$want" > "$stamp"
fi
