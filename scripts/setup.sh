#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with repaudit (editable), what `repaudit
# run` needs (the [run] extra) and the test dependencies, pinned by constraints/cpu.txt;
# Chromium for the report screenshot test.
# Re-running is quick: nothing is reinstalled unless pyproject.toml or the pins changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.repaudit-setup
want=$(cat pyproject.toml constraints/cpu.txt | sha256sum | cut -d' ' -f1)
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -c constraints/cpu.txt -e '.[run,test]'
  echo "$want" > "$stamp"
fi
if ! command -v chromium >/dev/null 2>&1 && [ "${REPAUDIT_SKIP_CHROMIUM:-0}" != 1 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing Chromium for the HTML report test (Debian package)" >&2
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "warning: chromium is missing and cannot be installed here (needs root + apt-get); the report screenshot test will fail" >&2
  fi
fi
