#!/usr/bin/env bash
# The README's first command: installs the environment (idempotent) and runs the default job, the CPU
# quickstart, fully offline. Extra arguments are config overrides, e.g. `scripts/quickstart.sh run.seed=2`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
source "$ROOT/scripts/cpu_env.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/asyncrl" quickstart --config configs/quickstart.yaml "$@"
