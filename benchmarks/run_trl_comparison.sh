#!/usr/bin/env bash
# TRL vs grpo on this machine; one command, prints a markdown table. Extra arguments go to the Python
# script (e.g. --workloads b --repeats 5 --threads 2). Needs a grpo venv (PYTHON, default python).
set -euo pipefail
PYTHON=${PYTHON:-python}
# A relative PYTHON (e.g. .venv/bin/python) is relative to the caller's directory, not benchmarks/.
case "$PYTHON" in */*) PYTHON="$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON")" ;; esac
cd "$(dirname "$0")"
if [ ! -x .venv-trl/bin/python ]; then
  "$PYTHON" -m venv .venv-trl
  # torch first and pinned, so pip never resolves another torch for TRL.
  .venv-trl/bin/pip install -q torch==2.13.0
  .venv-trl/bin/pip install -q trl==1.16.0 transformers==5.23.0 datasets peft==0.21.2  # peft: real_size.py LoRA
fi
exec "$PYTHON" run_trl_comparison.py "$@"
