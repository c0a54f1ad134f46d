#!/usr/bin/env bash
# Install (if needed), then run the default audit matrix on the built-in tiny model, on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/repaudit run "$@"
