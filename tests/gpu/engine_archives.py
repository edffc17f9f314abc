#!/usr/bin/env python3
"""Pack an installed engine's Python for tests/gpu/engine_probe.py (no compiled extension travels).

    python3 tests/gpu/engine_archives.py SITE_PACKAGES vllm 0.33.0 .engines/vllm-py.tar.xz
    python3 tests/gpu/engine_archives.py SITE_PACKAGES sglang 0.5.23 .engines/sglang-py.tar.xz

Takes the package's ``.py`` files and small data files (json configs, templates; SGLang's JIT kernel sources,
whose folders it checks for at import) and its dist-info (entry points), after checking each file against the
wheel's RECORD: a file changed since the install stops the packing.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import lzma
import sys
import tarfile
from pathlib import Path

DATA_SUFFIXES = {".py", ".pyi", ".json", ".jinja", ".jinja2", ".yaml", ".yml", ".txt", ".typed", ".toml"}
WHOLE_FOLDERS = ("sglang/kernels/jit/",)  # sglang/kernels/jit/utils/compile/paths.py needs include/ and csrc/
LARGEST_FILE = 2_000_000
DIST_FILES = ("METADATA", "entry_points.txt", "top_level.txt", "WHEEL")


def wanted(relative: str, size: int) -> bool:
    if relative.endswith((".so", ".pyc")) or "/__pycache__/" in relative or size > LARGEST_FILE:
        return False
    if relative.startswith(WHOLE_FOLDERS):
        return True
    return Path(relative).suffix in DATA_SUFFIXES and ("/third_party/" not in relative or relative.endswith(".py"))


def main(site: str, package: str, version: str, archive: str) -> int:
    site_packages = Path(site)
    dist = site_packages / f"{package}-{version}.dist-info"
    record = {row[0]: row[1] for row in csv.reader(open(dist / "RECORD")) if row}
    files, changed = [], []
    for path in sorted((site_packages / package).rglob("*")):
        relative = path.relative_to(site_packages).as_posix()
        if not path.is_file() or not wanted(relative, path.stat().st_size):
            continue
        algorithm, _, digest = record.get(relative, "sha256=").partition("=")
        actual = base64.urlsafe_b64encode(hashlib.new(algorithm, path.read_bytes()).digest()).rstrip(b"=").decode()
        if actual != digest:
            changed.append(relative)
        files.append(relative)
    if changed:
        print(f"{len(changed)} files differ from {package}'s RECORD, e.g. {changed[:5]}: reinstall it", file=sys.stderr)
        return 1
    files += [f"{dist.name}/{name}" for name in DIST_FILES if (dist / name).exists()]
    with tarfile.open(archive, "w:xz", preset=9 | lzma.PRESET_EXTREME) as tar:
        for relative in files:
            tar.add(site_packages / relative, arcname=relative, recursive=False)
    print(f"{archive}: {len(files)} files of {package} {version}, {Path(archive).stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
