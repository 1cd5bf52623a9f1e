#!/usr/bin/env bash
# Set up (first run: .venv with the CPU stack) and run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/setup_env.sh
export OMP_NUM_THREADS=1
python -m ruff check megatron_dapo tools tests benchmarks
exec python -m pytest -q -p no:cacheprovider --durations=30 "$@"
