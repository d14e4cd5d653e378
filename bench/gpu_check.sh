#!/usr/bin/env bash
# The GPU check in one command: bash bench/gpu_check.sh [--dry-run] OUT
# (see bench/gpu_check.py). On the GPU machine flatshard is used from this checkout (PYTHONPATH).
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
exec python3 bench/gpu_check.py "$@"
