#!/usr/bin/env bash
# A bare install as a user makes it: the wheel with its declared dependencies only (no dev or other extras) in
# a new virtual environment, then the commands that need no model and no network, run from a folder outside
# the checkout. Catches a run-time dependency that only the dev extras bring (numpy had been one).
#   bash tools/check_install.sh          (PYTHON: the interpreter that builds the wheel and the venv)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
PYTHON=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PYTHON" -m pip wheel -q --no-deps -w "$work/dist" .
"$PYTHON" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q --disable-pip-version-check -c "$root/constraints-dev.txt" "$work"/dist/rotationzoo-*.whl
cd "$work"
export ROTATIONZOO_CACHE="$work/cache"
rz="$work/venv/bin/rotationzoo"
"$rz" --version
# the bundled entry, resolved, verified, loaded and quantized: nothing on stderr (no missing-package warning)
if ! "$rz" demo --json > demo.json 2> demo.err || [ -s demo.err ]; then
  cat demo.err >&2; echo "check-install: demo failed or wrote to stderr (above)" >&2; exit 1
fi
"$rz" export SmolLM2-135M-Instruct --to safetensors --out pair.safetensors
"$rz" verify pair.safetensors > /dev/null
echo "check-install: ok"
