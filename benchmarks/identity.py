"""What content identity costs: an unchanged checkpoint (digests remembered) vs first sight (hashed).

    python benchmarks/identity.py [--files 100] [--file-kib 256] [--runs 11] [--big-gib 1]

Rows: ``checkpoint_identity`` of a checkpoint of ``--files`` safetensors files with the
digest store warm (a stat and one small read per file), the same with no store (every
file hashed: first sight), and the previous header-only scheme (one header read per file)
for comparison; then the hashing rate of one ``--big-gib`` file (page cache warm) with
the digest's thread pool, and one sha256 stream for reference. Medians (and the fastest
run: the machine's noise aside) of ``--runs``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from weightcache.core.identity.digests import DigestStore, file_digest, hashing_threads
from weightcache.core.identity.safetensors_io import checkpoint_files, checkpoint_identity, read_header


def _times_ms(function, runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        function()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def _checkpoint(directory: Path, files: int, file_kib: int) -> Path:
    rng = np.random.default_rng(0)
    for index in range(files):
        tensor = rng.standard_normal(file_kib * 256, dtype=np.float32)
        save_file({f"layers.{index}.weight": tensor}, str(directory / f"model-{index + 1:05d}-of-{files:05d}.safetensors"))
    return directory


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=100)
    parser.add_argument("--file-kib", type=int, default=256)
    parser.add_argument("--runs", type=int, default=11)
    parser.add_argument("--big-gib", type=float, default=1.0)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="wc-identity-") as scratch:
        scratch = Path(scratch)
        (scratch / "model").mkdir()
        path = _checkpoint(scratch / "model", args.files, args.file_kib)
        time.sleep(0.2)  # older than the racy window, so digests are remembered
        store = DigestStore.open(scratch / "digests")
        checkpoint_identity(path, store)  # first sight: remembers every digest
        files = checkpoint_files(path)
        rows = [
            (f"unchanged, {args.files} files (store hit)", _times_ms(lambda: checkpoint_identity(path, store), args.runs)),
            (
                f"first sight, {args.files} files x {args.file_kib} KiB (hash)",
                _times_ms(lambda: checkpoint_identity(path, DigestStore(None)), args.runs),
            ),
            (f"previous scheme: {args.files} headers read", _times_ms(lambda: [read_header(f) for f in files], args.runs)),
        ]

        big = scratch / "big.safetensors"
        nbytes = int(args.big_gib * 2**30)
        with open(big, "wb") as fh:
            block = os.urandom(64 << 20)
            fh.writelines(block[: min(len(block), nbytes - offset)] for offset in range(0, nbytes, len(block)))
        file_digest(big)  # warms the page cache
        big_runs = max(3, args.runs // 3)
        digest_ms = statistics.median(_times_ms(lambda: file_digest(big), big_runs))
        sample = block * 4
        stream_ms = statistics.median(_times_ms(lambda: hashlib.sha256(sample).digest(), big_runs)) * nbytes / len(sample)

    print(f"\ncheckpoint identity, median of {args.runs} runs ({os.cpu_count()} CPUs, {hashing_threads()} hashing threads)\n")
    print("| measure | median | fastest |")
    print("|---|---|---|")
    for label, times in rows:
        print(f"| {label} | {statistics.median(times):.2f} ms | {min(times):.2f} ms |")
    print(f"\none {args.big_gib:g} GiB file, page cache warm, median of {big_runs} runs\n")
    print("| measure | time | rate |")
    print("|---|---|---|")
    print(
        f"| `file_digest` ({hashing_threads()} threads, 64 MiB pieces) | {digest_ms:.0f} ms | {nbytes / digest_ms / 1e6:.2f} GB/s |"
    )
    print(f"| one sha256 stream (in memory) | {stream_ms:.0f} ms | {nbytes / stream_ms / 1e6:.2f} GB/s |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
