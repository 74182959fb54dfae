#!/usr/bin/env bash
# The main job: the engine answers a question about a long document through the embedded KV cache,
# twice, in two processes; the second loads the document's KV from the cache instead of recomputing it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
KV_URL=${KV_URL:-local://$WORK/store}  # a fresh store: the first run is cold
{
  echo "Read this report and answer the question at the end."
  for i in $(seq 1 36); do
    echo "Section $i. The cache service keeps attention keys and values of earlier prompts in a hierarchy of memories: device memory, pinned host memory, local NVMe and object storage. Blocks of sixteen tokens are identified by chained hashes, so a shared prefix maps to shared blocks."
  done
  echo "Question: what is the capital of France? Answer in one sentence."
} > "$WORK/prompt.txt"
for run in cold warm; do
  echo "== $run run (a new process) =="
  "$PY" -m engine.cli generate --model "${MODEL:-smollm2}" --prompt-file "$WORK/prompt.txt" --max-tokens 48 \
    --kv-connector "$KV_URL" --json "$@" > "$WORK/$run.json"
  "$PY" - "$WORK/$run.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
hits = ", ".join(f"{k} {v}" for k, v in s["tier_hits"].items()) or "none"
print(s["text"])
print(f"[tierkv] prompt {s['prompt_tokens']} tokens, {s['cached_tokens']} loaded from the KV cache "
      f"(blocks per tier: {hits}); TTFT {s['ttft_s']:.3f} s, total {s['total_s']:.3f} s")
PY
done
"$PY" - "$WORK/cold.json" "$WORK/warm.json" <<'PY'
import json, sys
cold, warm = (json.load(open(p)) for p in sys.argv[1:])
same = "same answer" if cold["token_ids"] == warm["token_ids"] else "DIFFERENT answers"
print(f"[tierkv] summary: TTFT cold {cold['ttft_s']:.3f} s, warm {warm['ttft_s']:.3f} s "
      f"({cold['ttft_s'] / max(warm['ttft_s'], 1e-9):.1f}x faster from the cache), {same}")
PY
