#!/usr/bin/env bash
# The peer for every TRL comparison: benchmarks/.venv-trl with TRL 1.16.0 (idempotent). PYTHON: the
# interpreter to build it from (default python3).
set -euo pipefail
PYTHON=${PYTHON:-python3}
case "$PYTHON" in */*) PYTHON="$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON")" ;; esac
cd "$(dirname "$0")"
if [ ! -x .venv-trl/bin/python ]; then
  "$PYTHON" -m venv .venv-trl
  # torch first and pinned, so pip never resolves another torch for TRL.
  .venv-trl/bin/pip install -q torch==2.13.0
  .venv-trl/bin/pip install -q trl==1.16.0 transformers==5.23.0 datasets peft==0.21.2  # peft: real_size.py LoRA
fi
