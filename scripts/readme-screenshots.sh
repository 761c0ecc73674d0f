#!/usr/bin/env bash
# The README's pictures of cohorts (docs/img/*.png): runs the cohort browser test
# (real Chromium over `schedule-lineage serve`), which keeps a screenshot of each
# element the README shows as readme-NAME.png in its test directory, and copies them
# to docs/img/NAME.png. PYTHON overrides the interpreter (default .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."

python="${PYTHON:-.venv/bin/python}"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
"$python" -m pytest tests/test_cohort_browser.py -q -p no:cacheprovider --basetemp="$scratch"
mkdir -p docs/img
for shot in "$scratch"/*/readme-*.png; do
  name="$(basename "$shot")"
  cp "$shot" "docs/img/${name#readme-}"
done
ls -l docs/img/
