#!/usr/bin/env bash
# The README's first command: installs the environment (idempotent) and runs the default job, the CPU
# quickstart, fully offline: synthetic data, the tiny model (built and warm-started locally, cached),
# then async RL. Extra arguments are config overrides, e.g. `scripts/quickstart.sh learner.total_steps=20`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
source "$ROOT/scripts/cpu_env.sh"
cd "$ROOT"
ASYNCRL="$ROOT/.venv/bin/asyncrl"
CONFIG=configs/quickstart.yaml
"$ASYNCRL" data --config "$CONFIG" "$@"
"$ASYNCRL" init-model --config "$CONFIG" "$@"
exec "$ASYNCRL" run --config "$CONFIG" "$@"
