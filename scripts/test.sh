#!/usr/bin/env bash
# The test command: installs what is missing, then runs the whole suite.
# Extra arguments go to pytest (e.g. scripts/test.sh tests/cache_service -x).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "${PYTHON:-python3}" -m pytest "${@:-tests}"
