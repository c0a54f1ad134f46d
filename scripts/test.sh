#!/usr/bin/env bash
# Install everything from project files, then run the whole test suite (CPU only).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -ra "$@"
