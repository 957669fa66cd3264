#!/usr/bin/env bash
# Creates .venv with Python 3.12 and installs moe_eplb_jax (editable) with its test and plot extras.
# Usage: bash scripts/venv.sh [--fresh]      (--fresh deletes an existing .venv first)
set -euo pipefail
cd "$(dirname "$0")/.."

find_python312() {
  if command -v pyenv >/dev/null 2>&1; then
    local v
    v=$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.|$)' | tail -1 || true)
    if [ -n "$v" ]; then
      echo "env PYENV_VERSION=$v python3.12"
      return 0
    fi
  fi
  local c
  for c in python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      echo "$c"
      return 0
    fi
  done
  return 1
}

if [ "${1:-}" = "--fresh" ]; then rm -rf .venv; fi
if [ ! -x .venv/bin/python ]; then
  PY=$(find_python312) || {
    echo "ERROR: Python 3.12 is required (jax 0.11 needs Python >= 3.12) and none was found." >&2
    echo "Install it (e.g. 'pyenv install 3.12' or your distribution's python3.12 package) and retry." >&2
    exit 1
  }
  echo "creating .venv with: $PY"
  $PY -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "jax==0.11.2" "jaxlib==0.11.2" -e ".[test,plot]"
.venv/bin/python -c "import jax, moe_eplb_jax; print('ready: jax', jax.__version__, '| moe_eplb_jax', moe_eplb_jax.__version__)"
