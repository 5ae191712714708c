#!/usr/bin/env bash
# TRL vs grpo on this machine; one command, prints a markdown table. Extra arguments go to the Python
# script (e.g. --workloads b --repeats 5 --threads 2). Needs a grpo venv (PYTHON, default python).
set -euo pipefail
PYTHON=${PYTHON:-python}
# A relative PYTHON (e.g. .venv/bin/python) is relative to the caller's directory, not benchmarks/.
case "$PYTHON" in */*) PYTHON="$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON")" ;; esac
cd "$(dirname "$0")"
PYTHON="$PYTHON" ./setup_trl_venv.sh
exec "$PYTHON" run_trl_comparison.py "$@"
