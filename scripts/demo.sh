#!/usr/bin/env bash
# The main job: the engine answers a prompt through the embedded KV cache, twice;
# the second run loads the prompt's KV from the cache instead of recomputing it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PROMPT_FILE=$(mktemp)
trap 'rm -f "$PROMPT_FILE"' EXIT
{
  echo "Read this report and answer the question at the end."
  for i in $(seq 1 12); do
    echo "Section $i. The cache service keeps attention keys and values of earlier prompts in a hierarchy of memories: device memory, pinned host memory, local NVMe and object storage. Blocks of sixteen tokens are identified by chained hashes, so a shared prefix maps to shared blocks."
  done
  echo "Question: what is the capital of France? Answer in one sentence."
} > "$PROMPT_FILE"
for run in first second; do
  echo "== $run run =="
  "${PYTHON:-python3}" -m engine.cli generate --model "${MODEL:-smollm2}" --prompt-file "$PROMPT_FILE" \
    --max-tokens 48 --kv-connector "${KV_URL:-local://}" "$@"
done
