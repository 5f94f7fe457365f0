#!/usr/bin/env bash
# Prints the path of a Python 3.12 interpreter: $PYTHON, then python3.12 on PATH,
# then pyenv's installs (whose shim on PATH only works when 3.12 is selected).
set -u
is_312() { "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1; }
for candidate in "${PYTHON:-}" python3.12 python3; do
  [ -n "$candidate" ] || continue
  path=$(command -v "$candidate" 2>/dev/null) || continue
  if is_312 "$path"; then echo "$path"; exit 0; fi
done
root=$(pyenv root 2>/dev/null || echo "${PYENV_ROOT:-$HOME/.pyenv}")
for path in "$root"/versions/3.12*/bin/python3.12; do
  if [ -x "$path" ] && is_312 "$path"; then echo "$path"; exit 0; fi
done
echo "error: no Python 3.12 found (tried \$PYTHON, python3.12, python3 on PATH, $root/versions/3.12*)." >&2
echo "Install Python 3.12 or set PYTHON=/path/to/python3.12." >&2
exit 1
