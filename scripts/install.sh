#!/usr/bin/env bash
# Create (or update) the virtual environment .venv with criticalkv and its extras, on a CPU machine.
#   bash scripts/install.sh            # the package, the test tools and the bundled data
#   VENV=/path/to/venv bash scripts/install.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet -c constraints-cpu.txt -e ".[test]"
echo "criticalkv installed in $VENV"
