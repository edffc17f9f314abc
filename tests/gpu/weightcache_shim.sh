#!/usr/bin/env bash
# weightcache on sys.path with its entry points, from a checkout and without pip: a folder holding a `weightcache`
# package made of links (core, adapters, conformance and the public modules beside them: the shim is the one
# weightcache package) and a dist-info with pyproject.toml's entry points (so vLLM and SGLang find their plugins).
#
#   SHIM=$(tests/gpu/weightcache_shim.sh ROOT)     prints the new folder (/tmp/wc-shim-XXXX); put it first on PYTHONPATH
#
# Used by tests/gpu/run_gpu.sh, tests/gpu/engine_gpu.sh and tests/engines/run_engines_gpu.sh.
set -uo pipefail
ROOT=${1:?usage: tests/gpu/weightcache_shim.sh ROOT}
SHIM=$(mktemp -d /tmp/wc-shim-XXXX)
mkdir -p "$SHIM/weightcache" "$SHIM/weightcache-0.0.0.dist-info"
for part in core adapters conformance; do ln -s "$ROOT/$part" "$SHIM/weightcache/$part"; done
for file in "$ROOT"/weightcache/*; do ln -s "$file" "$SHIM/weightcache/"; done
printf 'Metadata-Version: 2.1\nName: weightcache\nVersion: 0.0.0\n' > "$SHIM/weightcache-0.0.0.dist-info/METADATA"
python3 - "$SHIM" "$ROOT/pyproject.toml" <<'PY'
import sys, tomllib
project = tomllib.load(open(sys.argv[2], "rb"))["project"]
lines = []
for group, entries in project.get("entry-points", {}).items():
    lines.append(f"[{group}]")
    lines += [f"{name} = {target}" for name, target in entries.items()]
open(f"{sys.argv[1]}/weightcache-0.0.0.dist-info/entry_points.txt", "w").write("\n".join(lines) + "\n")
PY
echo "$SHIM"
