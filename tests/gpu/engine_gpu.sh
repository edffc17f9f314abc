#!/usr/bin/env bash
# vLLM 0.33.0 through weightcache on the H200 machine, in the device call that brings the last piece of
# tests/gpu/engine_wheels.sh's pack (the pieces already in /tmp/eng):
#
#   tests/gpu/engine_gpu.sh OUT [SHAPE]     SHAPE: small (default), 8b or moe (tests/gpu/engine_model.py)
#
# 1. installs the pack into /tmp/site (pip --no-deps --target; torch 2.11 stays the machine's own);
# 2. imports vLLM and loads its compiled kernels (_C_stable_libtorch, _moe_C, FlashAttention 3) on torch 2.11;
# 3. writes a Qwen3-shaped checkpoint with random bf16 weights (drawn on the GPU);
# 4. vllm.LLM: plain load, weightcache daemon, weightcache strict client, greedy tokens compared
#    (tests/gpu/engine_llm.py; CUDA graphs captured, no torch.compile; eager again, and for the steps after, if that
#    fails);
# 5. two vllm.LLM strict clients serving the daemon's entry at once (GPU memory against the entry's bytes), then the
#    server SIGKILLed while one generates (tests/gpu/engine_pair.py);
# 6. vllm serve the same three ways as 4 through tests/engines/run_engines_gpu.sh (completions compared, the
#    client attached to the one entry).
# Each step's log (and the JSON the steps write) goes to a folder that ends as OUT/engine-gpu.tgz (a device call
# brings back at most 8 files; steps.txt, llm.json and pair.json are copied beside it); the last lines of each step
# go to stdout. A failed install, import or model step stops the run (nothing after it could work); a failed later
# step does not. Every step's time limit is cut to what is left of WC_DEADLINE_S (default 570 s, inside one 600 s
# device call); WC_VARIANT_TIMEOUT_S bounds each engine start of steps 4 and 5.
set -uo pipefail
OUT=${1:?usage: tests/gpu/engine_gpu.sh OUT [small|8b|moe]}
SHAPE=${2:-small}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SITE=${WC_ENGINE_SITE:-/tmp/site}
MODEL=/tmp/wc-model-$SHAPE
DEADLINE=$((SECONDS + ${WC_DEADLINE_S:-570}))
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOGS=$(mktemp -d /tmp/wc-engine-gpu-XXXX)
stop_server() {  # stop_server SOCKET_DIR: SIGKILL the server a daemon-mode engine left there (its pid from status)
  [ -S "$1/weightcache.sock" ] || return 0
  local pid
  pid=$(python3 -c 'import sys; from weightcache.core.client.client import Connection
with Connection(sys.argv[1]) as c: print(c.status()["pid"])' "$1" 2>/dev/null) && [ -n "$pid" ] && kill -9 "$pid" 2>/dev/null
  return 0
}
finish() {
  stop_server /tmp/wc-llm
  stop_server /tmp/wc-llm-eager
  for file in steps.txt llm.json llm-eager.json pair.json; do cp "$LOGS/$file" "$OUT"/ 2>/dev/null; done
  tar -czf "$OUT/engine-gpu.tgz" -C "$LOGS" . 2>/dev/null
}
trap finish EXIT
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # the machines' rule (KINDS.md)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1 VLLM_DO_NOT_TRACK=1
export TOKENIZERS_PARALLELISM=false
# FlashInfer is not carried (tests/gpu/engine-wheels.txt), and vLLM 0.33.0's sampler imports it unguarded unless this
# is 0 (its other uses check has_flashinfer() first): seen on the H100 machine, 2026-12-05 (docs/engines.md)
export VLLM_USE_FLASHINFER_SAMPLER=0

step() {  # step NAME TIMEOUT COMMAND...: run (within the deadline), log, time
  local name=$1 limit=$2 start=$SECONDS; shift 2
  (( limit > DEADLINE - SECONDS )) && limit=$((DEADLINE - SECONDS))
  (( limit > 5 )) || { echo "$name: no time left" | tee -a "$LOGS/steps.txt"; return 1; }
  echo "== $name ($(date -u +%H:%M:%S), at most ${limit}s)"
  timeout -k 5 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  tail -n 30 "$LOGS/$name.log" | cut -c1-400
  echo "$name rc=$rc $((SECONDS - start))s" | tee -a "$LOGS/steps.txt"
  return "$rc"
}

# weightcache on sys.path with its entry points (vLLM finds its plugin there)
SHIM=$("$ROOT/tests/gpu/weightcache_shim.sh" "$ROOT")
export PYTHONPATH="$SHIM:$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"

{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; } > "$LOGS/machine.txt" 2>&1
[ -d "$SITE/vllm" ] || step install 180 "$ROOT/tests/gpu/engine_wheels.sh" --install /tmp/eng "$SITE" || exit 1
step import 240 python3 - <<'PY' || exit 1
import importlib, time
t = time.monotonic()
import torch, vllm
print("vllm", vllm.__version__, "from", vllm.__file__, "torch", torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name(0), f"import {time.monotonic() - t:.1f}s")
for name in ("vllm._C_stable_libtorch", "vllm._moe_C_stable_libtorch", "vllm.vllm_flash_attn._vllm_fa3_C"):
    try:
        importlib.import_module(name)
        print("loaded", name)
    except Exception as exc:
        print("FAILED", name, type(exc).__name__, exc)
try:  # one of vLLM's own CUDA kernels, called through torch 2.11's dispatcher
    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(256, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(x)
    torch.ops._C.rms_norm(out, x, w, 1e-6)
    ref = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    print("_C rms_norm on cuda, max error vs torch:", (out.float() - ref).abs().max().item())
except Exception as exc:
    print("FAILED _C rms_norm", type(exc).__name__, exc)
from vllm.v1.sample.ops.topk_topp_sampler import flashinfer_sampler_supported
print("FlashInfer sampler:", flashinfer_sampler_supported(), "(False: torch's top-k/top-p; FlashInfer is not carried)")
import vllm.model_executor.model_loader.weight_cache.protocol, weightcache.adapters.vllm.loader
print("vLLM loader modules and the weightcache adapter import")
PY
step model 300 python3 "$ROOT/tests/gpu/engine_model.py" "$MODEL" --shape "$SHAPE" || exit 1
# CUDA graphs first; if the plain load fails with them (exit 2), the same again without (what failed stays in llm.log), and
# the steps after run eager too
EAGER=()
step llm 400 python3 "$ROOT/tests/gpu/engine_llm.py" "$MODEL" "$LOGS/llm.json" --socket-dir /tmp/wc-llm
if [ $? = 2 ]; then  # the plain load itself failed (not a difference between the loads)
  stop_server /tmp/wc-llm  # a daemon variant may have published before it failed: free the GPU of that entry
  EAGER=(--eager)
  step llm-eager 300 python3 "$ROOT/tests/gpu/engine_llm.py" "$MODEL" "$LOGS/llm-eager.json" --eager \
    --socket-dir /tmp/wc-llm-eager
fi
SOCKET=/tmp/wc-llm REFERENCE=$LOGS/llm.json
[ ${#EAGER[@]} = 0 ] || { SOCKET=/tmp/wc-llm-eager REFERENCE=$LOGS/llm-eager.json; }
# the daemon variant's server still holds the entry; the pair ends it (SIGKILL), whatever happens
step pair 300 python3 "$ROOT/tests/gpu/engine_pair.py" "$MODEL" "$LOGS/pair.json" --socket-dir "$SOCKET" \
  --expect "$REFERENCE" "${EAGER[@]}"
GRAPHS='--compilation-config {"mode":0,"cudagraph_mode":"FULL_DECODE_ONLY","cudagraph_capture_sizes":[1,2,4]}'
[ ${#EAGER[@]} = 0 ] || GRAPHS=--enforce-eager
ENGINES=vllm VLLM_ARGS=$GRAPHS PROMPTS='["t11 t250 t3999 t42", "t5 t6 t7 t8", "t31000 t2 t77"]' \
  step serve 400 "$ROOT/tests/engines/run_engines_gpu.sh" "$LOGS/serve" "$MODEL"
