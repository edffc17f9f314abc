#!/usr/bin/env bash
# vLLM 0.33.0 with its own compiled kernels for the H200 machine (torch 2.11.0+cu130, CUDA 13.0, Python 3.12, no
# network), packed here and carried in pieces, one a device call (64 MiB a call). docs/engines.md, "vLLM on the H200".
#
#   tests/gpu/engine_wheels.sh [DIR]              here, in the checkout's root: pack DIR (default .eng; ignore it:
#                                                  echo /.eng/ >> .git/info/exclude) and print the carry plan
#   tests/gpu/engine_wheels.sh --install SRC SITE  there: join the pieces in SRC, check them, install into SITE
#
# Why vLLM 0.33.0 fits torch 2.11: its kernels (_C_stable_libtorch, _moe_C_stable_libtorch, vllm_flash_attn's
# _vllm_fa3_C) are built on torch's stable C ABI (aoti_torch_*/torch_* functions, no C++ symbols of torch), each
# links libcudart.so.13, and every torch symbol they need is exported by torch 2.11.0's libraries; the wheel's
# `torch==2.14.0` pin is all that stops it (installed with --no-deps). The vLLM that declares torch 2.11 (0.26.0)
# has no model_loader.weight_cache, which the weightcache adapter imports, and SGLang's kernels for 0.5.23
# (sglang-kernel 0.4.10) use torch's C++ ABI and miss 5 of its symbols in torch 2.11.
#
# Dropped from the vLLM wheel (its RECORD loses their lines): FlashAttention 2 (the H200 runs FA3), the Rust
# frontend binary, DeepGEMM (vendored; vLLM runs without it), the SM100 attention and the FlashMLA/FlashKDA/
# DeepSelect/QuTLASS kernels (MLA, KDA, Blackwell). WC_ENGINE_MOE=0 drops _moe_C too (dense models only, one piece
# fewer). The dependencies the image lacks come from tests/gpu/engine-wheels.txt.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
VLLM=vllm==0.33.0
PIECE_MIB=${WC_PIECE_MIB:-58}  # the checkout that travels with each piece is about 4 MiB
PYTHON_VERSION=${WC_DEVICE_PYTHON:-3.12}
NAME=engine-wheels.tar

if [ "${1:-}" = --install ]; then
  SRC=${2:?usage: engine_wheels.sh --install SRC SITE}
  SITE=${3:?usage: engine_wheels.sh --install SRC SITE}
  missing=$(cd "$SRC" && awk '{print $2}' "$NAME.parts" | while read -r part; do [ -e "$part" ] || echo "$part"; done)
  [ -z "$missing" ] || { echo "engine_wheels: missing in $SRC: $missing (carry them, one a call, within 30 s)" >&2; exit 1; }
  (cd "$SRC" && sha256sum -c --quiet "$NAME.parts") || { echo "engine_wheels: a piece in $SRC is damaged" >&2; exit 1; }
  mkdir -p "$SRC/unpacked"
  (cd "$SRC" && awk '{print $2}' "$NAME.parts" | xargs cat) | tar -x -C "$SRC/unpacked"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$SRC"/unpacked/wheels/*.whl
  echo "engine_wheels: $(ls "$SRC"/unpacked/wheels | wc -l) wheels installed in $SITE"
  exit 0
fi

DIR=${1:-.eng}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
WORK=$(mktemp -d /tmp/wc-engine-wheels-XXXX)
trap 'rm -rf "$WORK"' EXIT
CACHE=${WC_WHEEL_CACHE:-$WORK/full}  # a folder that already holds the vLLM wheel saves a 336 MB download
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 "$@"
}
download -d "$CACHE" "$VLLM"
mkdir -p "$WORK/wheels"
download -d "$WORK/wheels" -r "$ROOT/tests/gpu/engine-wheels.txt"

wheel=$(ls "$CACHE"/vllm-0.33.0-*.whl)
slim="$WORK/wheels/$(basename "$wheel")"
cp "$wheel" "$slim"
drop=(vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs 'vllm/third_party/deep_gemm/*'
  'vllm/third_party/fmha_sm100/*' vllm/_flashmla_C.abi3.so vllm/_flashmla_extension_C.abi3.so
  vllm/_flashkda_C.abi3.so vllm/_deepselect_C.abi3.so vllm/_qutlass_C.abi3.so)
[ "${WC_ENGINE_MOE:-1}" = 0 ] && drop+=(vllm/_moe_C_stable_libtorch.abi3.so)
zip -q -d "$slim" "${drop[@]}"
record=vllm-0.33.0.dist-info/RECORD
mkdir -p "$WORK/record/${record%/*}"
unzip -p "$wheel" "$record" > "$WORK/all-records"
unzip -Z1 "$slim" | awk -F, 'NR == FNR {kept[$0] = 1; next} ($1 in kept) || $1 == "'"$record"'"' - "$WORK/all-records" \
  > "$WORK/record/$record"
(cd "$WORK/record" && zip -q "$slim" "$record")
members=$(unzip -Z1 "$slim")
for so in vllm/_C_stable_libtorch.abi3.so vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so; do
  grep -qx "$so" <<< "$members" || { echo "engine_wheels: $so is not in $(basename "$wheel")" >&2; exit 1; }
done

rm -f "$DIR/$NAME".*
tar -cf "$WORK/$NAME" -C "$WORK" wheels
split -b "${PIECE_MIB}M" -d -a 2 "$WORK/$NAME" "$DIR/$NAME.part"
(cd "$DIR" && sha256sum "$NAME".part* > "$NAME.parts")
count=$(wc -l < "$DIR/$NAME.parts")
du -cb "$WORK"/wheels/*.whl | tail -n 1 | awk -v n="$(ls "$WORK"/wheels | wc -l)" -v s="$(du -b "$slim" | cut -f1)" \
  '{printf "engine_wheels: %d wheels, %.1f MB (vLLM slimmed to %.1f MB)\n", n, $1 / 1e6, s / 1e6}'
ls -l "$DIR"
rel=${DIR#"$PWD"/}  # the path the device sees, from the checkout root it runs in
echo "carry plan: $count device calls back to back (the machine keeps /tmp only 30 s after a call):"
i=0
for part in $(awk '{print $2}' "$DIR/$NAME.parts"); do
  i=$((i + 1))
  carry="[\"$rel/$part\"]"
  [ "$i" = "$count" ] && carry="[\"$rel/$part\", \"$rel/$NAME.parts\"]"
  echo "  call $i: carry $carry; command: mkdir -p /tmp/eng && mv $rel/$NAME.* /tmp/eng/ && ls -l /tmp/eng"
done
echo "  in call $count, after the move: tests/gpu/engine_gpu.sh \$OUT (installs into /tmp/site and runs)"
