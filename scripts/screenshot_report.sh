#!/usr/bin/env bash
# Render a run report in headless Chromium and save a screenshot, to check by eye that it shows the curves.
#   scripts/screenshot_report.sh RUN_DIR [OUT.png]      (writes the report first if it is missing)
set -euo pipefail
run_dir=${1:?usage: scripts/screenshot_report.sh RUN_DIR [OUT.png]}
out=${2:-$run_dir/report/screenshot.png}
[ -f "$run_dir/report/index.html" ] || grpo report "$run_dir"
browser=$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)
[ -n "$browser" ] || { echo "no Chromium found (Debian: apt-get install -y chromium)" >&2; exit 1; }
profile=$(mktemp -d)
trap 'rm -rf "$profile"' EXIT
"$browser" --headless --no-sandbox --disable-gpu --no-first-run --disable-background-networking \
  --disable-component-update --disable-sync --hide-scrollbars --user-data-dir="$profile" \
  --window-size=1400,2200 --screenshot="$(realpath -m "$out")" "file://$(realpath "$run_dir/report/index.html")" \
  >/dev/null 2>&1
echo "$out"
