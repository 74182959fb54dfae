#!/usr/bin/env bash
# Installs what tierkv needs on a fresh Debian machine; fast no-op when done.
# System: libxxhash-dev (C hash accelerator), redis-server (tests).
# Python: torch 2.13.0 (CPU build; pinned so pip never pulls a CUDA build), then tierkv[dev].
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

need_apt=()
[ -f /usr/include/xxhash.h ] || need_apt+=(libxxhash-dev)
command -v redis-server >/dev/null || need_apt+=(redis-server)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "install: apt-get install ${need_apt[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
  else
    echo "install: please install ${need_apt[*]} (apt); continuing without" >&2
  fi
fi

stamp=.tierkv-install.stamp
stale=0
for f in pyproject.toml setup.py cache_service/blocks/_hashchain.c tiers/_fastcopy.c tiers/_presence.c tiers/_slotio.c; do [ "$f" -nt "$stamp" ] && stale=1; done
"$PY" -c "import torch, triton, lmdb, xxhash, fastapi, uvicorn, cache_service.blocks._hashchain, tiers._fastcopy, tiers._presence, tiers._slotio" 2>/dev/null || stale=1
# the editable install must point at this checkout (a copy moved or cloned elsewhere keeps the old one's path)
here=$(pwd -P)
(cd / && "$PY" -c "import os, sys, engine; sys.exit(not os.path.realpath(engine.__file__).startswith('$here/'))") \
  2>/dev/null || stale=1
if [ ! -f "$stamp" ] || [ "$stale" = 1 ]; then
  echo "install: pip install torch==2.13.0 and tierkv[dev] (editable)"
  "$PY" -m pip install -q --disable-pip-version-check "torch==2.13.0" 2>&1 | grep -v "as the 'root' user" || true
  "$PY" -m pip install -q --disable-pip-version-check -e ".[dev]" 2>&1 | grep -v "as the 'root' user" || true
  "$PY" -c "import torch, triton, lmdb, xxhash" || { echo "install: python packages missing after pip" >&2; exit 1; }
  touch "$stamp"
fi
