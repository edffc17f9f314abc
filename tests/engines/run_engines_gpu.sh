#!/usr/bin/env bash
# vLLM and SGLang serving through weightcache on a GPU machine, compared with each engine's plain load.
#
#   tests/engines/run_engines_gpu.sh OUTDIR [MODEL]
#
# For each engine whose Python is given (VLLM_PYTHON, SGLANG_PYTHON; default: python3 if it imports the engine):
#   1. plain:  the engine's own load (--load-format auto)                      -> greedy completions
#   2. daemon: --load-format weightcache, mode daemon (loads, publishes, maps)  -> greedy completions
#   3. client: --load-format weightcache, mode client, strict (maps the entry) -> greedy completions
# then checks that 2 and 3 equal 1 token for token (temperature 0), that while the client ran the server held one
# entry and the client had it attached (it mapped, never published), and records each start-up time.
#
# Needs: a CUDA GPU; vLLM 0.33.0 and/or SGLang 0.5.23 installed with their CUDA torch; cuda-bindings in each
# engine's Python (pip install cuda-bindings); curl. MODEL (default Qwen/Qwen2.5-0.5B-Instruct) must be a local
# directory or be in the Hugging Face cache. weightcache itself is put on the path from this checkout with its
# entry points (so both engines find their plugins), without pip. Logs and JSON go to OUTDIR.
# Environment: ENGINES (default "vllm sglang"), VLLM_ARGS / SGLANG_ARGS (more arguments for every start of that
# engine, split on spaces), PROMPTS (a JSON list of strings), PORT, MEM.
# On the H200 machine it runs from tests/gpu/engine_gpu.sh, with vLLM 0.33.0 carried by tests/gpu/engine_wheels.sh
# (docs/engines.md, "vLLM on the H200"). Not run by CI or on the development machines (no GPU there).
set -uo pipefail
OUT=${1:?usage: tests/engines/run_engines_gpu.sh OUTDIR [MODEL]}
MODEL=${2:-${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}}
PORT=${PORT:-8765}
MEM=${MEM:-0.35}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
SOCK=$(mktemp -d /tmp/wc-engines-XXXX)
chmod 700 "$SOCK"

# weightcache on sys.path with its entry points (a dist-info beside the package), without pip.
SHIM=$("$ROOT/tests/gpu/weightcache_shim.sh" "$ROOT")
export PYTHONPATH="$SHIM:$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

SERVER_PID=""
ENGINE_PID=""
cleanup() {
  [ -n "$ENGINE_PID" ] && kill "$ENGINE_PID" 2>/dev/null
  [ -n "$SERVER_PID" ] && kill "$SERVER_PID" 2>/dev/null
  wait 2>/dev/null
  rm -rf "$SHIM"
}
trap cleanup EXIT

PROMPTS=${PROMPTS:-'["The capital of France is", "def fibonacci(n):", "Water boils at", "The three laws of robotics are", "Once upon a time"]'}

wait_ready() {  # wait_ready LOGFILE -> prints seconds to ready, or fails after 20 minutes
  local start=$SECONDS
  until curl -sf "http://127.0.0.1:$PORT/v1/models" >/dev/null; do
    if ! kill -0 "$ENGINE_PID" 2>/dev/null; then echo "engine died; see $1" >&2; return 1; fi
    if (( SECONDS - start > 1200 )); then echo "engine not ready after 20 minutes; see $1" >&2; return 1; fi
    sleep 1
  done
  echo $(( SECONDS - start ))
}

complete() {  # complete PYTHON OUTFILE: greedy completions of PROMPTS as JSON
  "$1" - "$PORT" "$MODEL" "$PROMPTS" "$2" <<'PY'
import json, sys, urllib.request
port, model, prompts, out = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
results = []
for prompt in prompts:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 48, "temperature": 0, "logprobs": 1}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    choice = json.load(urllib.request.urlopen(request, timeout=600))["choices"][0]
    results.append({"prompt": prompt, "text": choice["text"], "tokens": (choice.get("logprobs") or {}).get("tokens")})
json.dump(results, open(out, "w"), indent=1)
PY
}

run_variant() {  # run_variant ENGINE PYTHON NAME [extra args...]
  local engine=$1 python=$2 name=$3; shift 3
  local log="$OUT/$engine-$name.log" extra
  if [ "$engine" = vllm ]; then
    read -r -a extra <<< "${VLLM_ARGS:-}"
    "$python" -m vllm.entrypoints.cli.main serve "$MODEL" --port "$PORT" --gpu-memory-utilization "$MEM" \
      --max-model-len 2048 "${extra[@]}" "$@" > "$log" 2>&1 &
  else
    read -r -a extra <<< "${SGLANG_ARGS:-}"
    "$python" -m sglang.launch_server --model-path "$MODEL" --port "$PORT" --mem-fraction-static "$MEM" \
      --context-length 2048 "${extra[@]}" "$@" > "$log" 2>&1 &
  fi
  ENGINE_PID=$!
  local ready
  ready=$(wait_ready "$log") || { kill "$ENGINE_PID" 2>/dev/null; wait "$ENGINE_PID" 2>/dev/null; ENGINE_PID=""; return 1; }
  complete "$python" "$OUT/$engine-$name.json" || status=1
  server_status > "$OUT/$engine-$name-status.json"  # while the engine runs: which entries, attached by whom
  echo "{\"engine\": \"$engine\", \"variant\": \"$name\", \"ready_s\": $ready}" >> "$OUT/startup.jsonl"
  kill "$ENGINE_PID"; wait "$ENGINE_PID" 2>/dev/null; ENGINE_PID=""
  echo "$engine $name: ready in ${ready}s"
}

server_status() {
  python3 - "$SOCK" <<'PY'
import json, sys
from weightcache.core.client.client import Connection
with Connection(sys.argv[1]) as connection:
    print(json.dumps(connection.status(), indent=1))
PY
}

evict_all() {
  python3 - "$SOCK" <<'PY'
import sys
from weightcache.core.client.client import Connection
with Connection(sys.argv[1]) as connection:
    for entry in connection.status()["entries"]:
        connection.evict(entry["digest"], force=True)
PY
}

check_mapped() {  # check_mapped ENGINE: while the client ran, the one entry was attached and nothing else published
  python3 - "$OUT/$1-client-status.json" <<'PY'
import json, sys
entries = json.load(open(sys.argv[1]))["entries"]
ok = len(entries) == 1 and entries[0]["attached_pids"]
print(f"{sys.argv[1]}: {len(entries)} entries, attached by {entries[0]['attached_pids'] if entries else []}: {'ok' if ok else 'NOT MAPPED'}")
sys.exit(0 if ok else 1)
PY
}

compare() {  # compare ENGINE VARIANT: the variant's completions equal the plain load's
  python3 - "$OUT/$1-plain.json" "$OUT/$1-$2.json" <<'PY'
import json, sys
plain, other = (json.load(open(p)) for p in sys.argv[1:3])
bad = [a["prompt"] for a, b in zip(plain, other) if (a["text"], a["tokens"]) != (b["text"], b["tokens"])]
print(f"{sys.argv[2]}: {'identical to the plain load' if not bad else 'DIFFERS for ' + repr(bad)}")
sys.exit(1 if bad else 0)
PY
}

status=0
{ date -u; nvidia-smi; } > "$OUT/machine.txt" 2>&1
python3 -m weightcache.core.cli.cli serve --socket-dir "$SOCK" > "$OUT/server.log" 2>&1 &
SERVER_PID=$!
sleep 2

for engine in ${ENGINES:-vllm sglang}; do
  var=$(echo "$engine" | tr a-z A-Z)_PYTHON
  python=${!var:-python3}
  if ! "$python" -c "import $engine, cuda.bindings" 2>/dev/null; then
    echo "skipping $engine: $python cannot import $engine and cuda.bindings (set $var)" | tee -a "$OUT/skipped.txt"
    continue
  fi
  "$python" -c "import $engine, torch; print('$engine', $engine.__version__, 'torch', torch.__version__, torch.version.cuda)" >> "$OUT/machine.txt" 2>&1
  daemon="{\"mode\": \"daemon\", \"socket_dir\": \"$SOCK\"}"
  client="{\"mode\": \"client\", \"socket_dir\": \"$SOCK\", \"strict\": true}"
  run_variant "$engine" "$python" plain || { status=1; continue; }
  run_variant "$engine" "$python" daemon --load-format weightcache --model-loader-extra-config "$daemon" || status=1
  run_variant "$engine" "$python" client --load-format weightcache --model-loader-extra-config "$client" || status=1
  for variant in daemon client; do compare "$engine" "$variant" | tee -a "$OUT/compare.txt" || status=1; done
  check_mapped "$engine" | tee -a "$OUT/compare.txt" || status=1
  evict_all  # the next engine starts from an empty server
done
exit $status
