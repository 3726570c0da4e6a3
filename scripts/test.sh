#!/usr/bin/env bash
# The README's test command: installs the environment (idempotent) and runs the test suite on CPU.
# Extra arguments go to pytest, e.g. `scripts/test.sh tests/unit -x`. GPU tests are skipped here;
# they run on a GPU machine with `scripts/test.sh -m gpu`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
source "$ROOT/scripts/cpu_env.sh"
cd "$ROOT"
if [ "$#" -eq 0 ]; then
    set -- -m "not gpu and not extended" --durations=25 tests  # the 25 slowest tests close the report: where the suite's time goes
fi
exec "$ROOT/.venv/bin/python" -m pytest "$@"
