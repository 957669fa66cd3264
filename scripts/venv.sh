#!/usr/bin/env bash
# Creates a Python 3.12 venv and installs moe_eplb_jax (editable) with its dev extra: the test extra, ruff, pyright.
# Usage: bash scripts/venv.sh [--fresh] [--jax VERSION] [--dir DIR]
#   --fresh        delete DIR first
#   --jax VERSION  X.Y.Z installs exactly that jax and jaxlib, X.Y the newest X.Y.* (default 0.11.2, the GPU
#                  machines'; 0.12 is the newest the package is tested on, see pyproject.toml)
#   --dir DIR      the venv's folder (default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
  sed -n '3,7p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

fresh=0
jax_version=0.11.2
dir=.venv
while [ $# -gt 0 ]; do
  case "$1" in
    --fresh) fresh=1 ;;
    --jax) [ $# -ge 2 ] || usage; jax_version=$2; shift ;;
    --dir) [ $# -ge 2 ] || usage; dir=$2; shift ;;
    *) echo "unknown argument: $1" >&2; usage ;;
  esac
  shift
done

# The jax/jaxlib requirement: an exact release, or the newest of one minor series.
if [[ "$jax_version" =~ ^([0-9]+)\.([0-9]+)$ ]]; then
  next="${BASH_REMATCH[1]}.$((BASH_REMATCH[2] + 1))"
  jax_requirement=">=$jax_version,<$next"
elif [[ "$jax_version" =~ ^[0-9]+\.[0-9]+\.[0-9]+(\.[0-9]+)?$ ]]; then
  jax_requirement="==$jax_version"
else
  echo "--jax must look like 0.12 or 0.11.2, got '$jax_version'" >&2
  exit 2
fi

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

if [ "$fresh" = 1 ]; then rm -rf "$dir"; fi
if [ ! -x "$dir/bin/python" ]; then
  PY=$(find_python312) || {
    echo "ERROR: Python 3.12 is required (jax 0.11 needs Python >= 3.12) and none was found." >&2
    echo "Install it (e.g. 'pyenv install 3.12' or your distribution's python3.12 package) and retry." >&2
    exit 1
  }
  echo "creating $dir with: $PY"
  $PY -m venv "$dir"
fi
"$dir/bin/python" -m pip install -q --upgrade pip
"$dir/bin/python" -m pip install -q "jax$jax_requirement" "jaxlib$jax_requirement" -e ".[dev]"
"$dir/bin/python" -c "import jax, moe_eplb_jax; print('ready: jax', jax.__version__, '| moe_eplb_jax', moe_eplb_jax.__version__)"
