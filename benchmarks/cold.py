"""Cold load of one checkpoint to a device: weightcache against the loaders its users would pick instead.

    python benchmarks/cold.py --make-checkpoint /tmp/ck --gib 0.05 --device cpu          # a smoke test on a CPU
    python benchmarks/cold.py --make-checkpoint /root/cold-ckpt --gib 16 --json OUT.json  # the H200: 16.06 GB Llama
    python benchmarks/cold.py --make-checkpoint /root/cold-8b --size 8b --json OUT.json   # restart.py's 8 B Qwen3
    python benchmarks/cold.py --model DIR --methods raw-direct,wc-publish-first --runs 3  # a subset, medians of 3

Side by side in one run, every method loads the same checkpoint in a fresh process (interpreter, torch
and the method's own package imported and the CUDA context made before the clock starts; the clock
stops after the device is synchronised) with the page cache dropped first (``sync; echo 3 >
/proc/sys/vm/drop_caches``; where that is refused, e.g. without root, ``posix_fadvise(DONTNEED)`` on
the files, and the table's ``cache`` column says so and gives the share ``mincore`` still finds
resident):

- ``raw-direct`` / ``raw-buffered``: the disk's limit: 16 threads ``preadv`` 64 MiB pieces (O_DIRECT
  into page-aligned buffers, or through the page cache) into pinned buffers, then to the device;
- ``safetensors-safe-open`` / ``safetensors-load-file``: ``safe_open(device=...)`` tensor by tensor,
  ``load_file(device=...)`` file by file;
- ``transformers``: ``AutoModelForCausalLM.from_pretrained(dtype=bfloat16, device_map=device)``;
- ``fastsafetensors``, ``runai``, ``tensorizer`` (its own format: the checkpoint is converted first,
  untimed), ``instanttensor``: skipped, with the import error as the reason, where not installed;
  ``serverless-llm-store``: a row saying why it cannot run here (it is not attempted);
- ``wc-reader``: weightcache's reader alone (``read_checkpoint`` into an ``ArenaBuilder``);
- ``wc-publish-first`` / ``wc-publish-remembered``: ``loader.prepare`` + ``loader.publish`` to a fresh
  server, with an empty digest store (first sight: ``WEIGHTCACHE_CACHE_DIR`` an empty directory) and
  with the digests remembered (the store a first-sight run left, or one filled beforehand, untimed);
  the adapter and its framework are imported before the clock, as the issue's target says;
- ``wc-cli`` / ``wc-cli-remembered``: the whole ``weightcache load --model DIR --dtype bfloat16
  --device D`` (``python -m weightcache.core.cli.cli``), from exec to exit, timed by this process, under a
  pseudo-terminal so that the CLI prints its notes; the arrival time of each note splits the wall
  clock into phases: start + checks (exec -> ``hashing ...`` or ``loading ...``), hashing, read +
  publish (-> ``published ...``), exit. Its clock includes the imports, so after a whole-cache drop a
  throwaway process imports the same libraries first (untimed; the checkpoint stays cold): a node that
  loads a new model has used its Python environment before (torch, transformers, and what transformers
  imports to read this model's config and build its class: 2,350 modules more on the H200 machine);
- ``wc-cli-layout``: the CLI on first sight of the checkpoint's bytes (no digest remembered) with the
  architecture's layout remembered (copied from the first-sight row's store), as for a fine-tune of a
  model this node has loaded before: the hf adapter then builds the model without transformers.

Every method's bytes are checked, outside the timed region, against safetensors' own load of the same
files, tensor by tensor on the device (``torch.equal`` on the bytes; dtype and shape too where the
method returns typed tensors; a tensor on another device counts as wrong). On a GPU the reference is
loaded once by a helper process and shared with every row through CUDA IPC (a row that cannot map it
reloads it and says so); on a CPU each row reloads it. weightcache's published rows are checked
through an attach of the published entry. A mismatch makes the row's ``verified`` column ``NO``, is
listed after the table and makes the exit status 1; ``--methods control-flip`` (buffered reads with
one byte changed after the clock) shows the check bites.

``--make-checkpoint DIR --gib 16`` writes a Llama-3-8B-shaped bf16 checkpoint (hidden 4096, 32 layers,
vocabulary 128256: 291 tensors, 16.06 GB, random N(0, 0.02) weights generated on ``--device``) as
transformers' ``save_pretrained`` lays it out (4 shards ``model-0000i-of-00004.safetensors``, their
index, ``config.json``), written with ``safetensors.torch.save_file`` for speed; other ``--gib``
values scale the width (32 layers, 291 tensors, about gib/16 x 16 GB). ``--size 8b`` (or any size of
``benchmarks/restart.py``) builds that benchmark's Qwen3-shaped model with its own builder
(``save_pretrained``). A checkpoint already in DIR with the same marker is reused.

On the GPU machine (Python 3.12, no network), the peers travel as wheels in ``.whl/`` (carry
``.whl``; see docs/benchmarks.md); install them first:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site

``tests/gpu/run_gpu.sh $OUT cold`` (16.06 GB Llama in /root/cold-ckpt) and ``... cold-8b`` do that and run
every row, one 10-minute device call each (carry ``.whl``); ``WC_COLD_ARGS`` adds options. The JSON is
rewritten after every row, so a call cut short keeps what it measured.

fastsafetensors looks up ``libcudart.so`` and ``libcufile.so.0``, names torch's CUDA wheels do not
provide: for its row this script links the nvidia-* packages' libraries (found with a glob under
site-packages) into a private folder on that process's ``LD_LIBRARY_PATH``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import restart  # benchmarks/restart.py: the Qwen3 sizes and builder, the child environment, page-cache helpers
from cold_checkpoint import ensure_checkpoint
from cold_child import run_role
from cold_methods import DEFAULT_THREADS, METHODS
from cold_parent import Parent, prime_disk, rotated
from cold_table import record_of, table

# --- main -------------------------------------------------------------------------------------------------------------


def parse_variant(text: str) -> tuple[str, dict]:
    """``[METHOD@]LABEL:ENV=VALUE[,ENV=VALUE]`` -> ``("METHOD [LABEL]", {ENV: VALUE})``; METHOD defaults to wc-reader.

    A malformed one, or a METHOD that is not one of METHODS: ValueError.
    """
    method, at, rest = text.partition("@")
    if not at:
        method, rest = "wc-reader", text
    label, _, assignments = rest.partition(":")
    pairs = [item.partition("=") for item in assignments.split(",") if item.strip()]
    if not label.strip() or not pairs or any(not key.strip() or not sep for key, sep, _ in pairs):
        raise ValueError(f"--reader-variant {text!r}: write [METHOD@]LABEL:ENV=VALUE[,ENV=VALUE]")
    if method.strip() not in METHODS or METHODS[method.strip()].kind == "none":
        raise ValueError(
            f"--reader-variant {text!r}: {method.strip()!r} is not a method that runs; choose from {', '.join(METHODS)}"
        )
    return f"{method.strip()} [{label.strip()}]", {key.strip(): value.strip() for key, _, value in pairs}


def parse_methods(text: str) -> list[str]:
    """``all``, or a comma-separated list of METHODS' names, in the order given (unknown names: ValueError)."""
    if text.strip() == "all":
        return [name for name, m in METHODS.items() if m.default]
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in METHODS]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; choose from {', '.join(METHODS)}")
    return names


def build_parser() -> argparse.ArgumentParser:
    """The command line (the helper processes' roles hidden)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", metavar="DIR", help="an existing safetensors checkpoint directory")
    where.add_argument(
        "--make-checkpoint", metavar="DIR", help="write the checkpoint of --gib/--size here (reused if there), then run"
    )
    parser.add_argument("--gib", type=float, default=16.0, help="Llama size for --make-checkpoint: 16 is Llama-3-8B (16.06 GB)")
    parser.add_argument(
        "--size", choices=sorted(restart.SIZES), help="instead: benchmarks/restart.py's Qwen3 of this size (8b: 16.4 GB)"
    )
    parser.add_argument("--device", default="cuda:0", help="cuda:N (default cuda:0) or cpu")
    parser.add_argument(
        "--methods", default="all", help=f"'all' or a comma-separated subset of: {', '.join(METHODS)}; 'none': only make"
    )
    parser.add_argument("--runs", type=int, default=1, help="runs of each method (fresh processes); the table shows medians")
    parser.add_argument(
        "--threads",
        type=int,
        default=DEFAULT_THREADS,
        help="threads of the raw readers (default 16, as weightcache's reader on a 16-core machine)",
    )
    parser.add_argument("--row-timeout", type=float, default=300.0, help="seconds one row may take (default 300)")
    parser.add_argument(
        "--no-bracket", action="store_true", help="do not repeat raw-direct (when it comes first) at the end of the run"
    )
    parser.add_argument(
        "--fastsafetensors-gds", action="store_true", help="let fastsafetensors try GPUDirect Storage (default: nogds)"
    )
    parser.add_argument("--json", metavar="PATH", help="write the full record as JSON")
    parser.add_argument(
        "--cli-verbose",
        action="store_true",
        help="run the wc-cli rows with -v and keep their timed debug lines (the JSON's 'timeline') to see where they wait",
    )
    parser.add_argument(
        "--reader-variant",
        action="append",
        default=[],
        metavar="[METHOD@]LABEL:ENV=VALUE[,ENV=VALUE]",
        help="one more row of METHOD (default wc-reader), run with these environment variables "
        "(e.g. 'wc-publish-first@pieces:WEIGHTCACHE_READ_BLOCK_KIB=0'); repeatable",
    )
    parser.add_argument(
        "--no-prime",
        action="store_true",
        help="do not read the checkpoint once before the first row (a fresh checkpoint may then sit in the VM host's cache)",
    )
    parser.add_argument("--role", choices=["child", "make", "reference", "convert", "remember"], help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--socket-dir", help=argparse.SUPPRESS)
    parser.add_argument("--reference", help=argparse.SUPPRESS)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.role:
        return run_role(args)
    try:
        names = [] if args.methods.strip() == "none" else parse_methods(args.methods)
        variants = dict(parse_variant(text) for text in args.reader_variant)
        names += list(variants)
    except ValueError as exc:
        parser.error(str(exc))
    if args.size and args.model:
        parser.error("--size goes with --make-checkpoint")
    command = " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])])
    work = Path(tempfile.mkdtemp(prefix="wc-cold-"))
    try:
        return measure(args, names, variants, command, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def measure(args, names: list[str], variants: dict[str, dict], command: str, work: Path) -> int:
    """Make or find the checkpoint, run every row, print the table (and write the JSON); 1 where bytes differ or a row broke."""
    began = time.monotonic()
    env = restart.weightcache_env(work)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    model = ensure_checkpoint(args, env) if args.make_checkpoint else Path(args.model).resolve()
    print(f"checkpoint ready after {time.monotonic() - began:.1f} s", flush=True)
    if not names:
        return 0
    if names[0] == "raw-direct" and len(names) > 2 and not args.no_bracket:
        names.append("raw-direct")  # again at the end: did the disk drift during the run?
    parent = Parent(args, model, env, work)
    try:
        parent.start_reference()
        if "tensorizer" in names:
            reason = parent.prepare_tensorizer()
            if reason:
                parent.skips["tensorizer"] = reason
        if "fastsafetensors" in names and args.device.startswith("cuda"):
            parent.prepare_fastsafetensors()
        print(f"set-up done after {time.monotonic() - began:.1f} s", flush=True)
        if not args.no_prime:
            print(f"primed the disk: {prime_disk(parent.files):.1f} s (untimed)", flush=True)
        results = run_rows(parent, names, variants, command, began)
        result = record_of(parent, results, command, time.monotonic() - began)
        text = table(result)
        result["table"] = text
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")
        print("\n" + text, flush=True)
        methods = result["methods"]
        mismatched = any(s["status"] == "ran" and not s["verified"] for s in methods.values())
        broken = any(s["status"] == "error" for s in methods.values())
        return 1 if mismatched or broken else 0
    finally:
        parent.stop_reference()


def run_rows(parent: Parent, names: list[str], variants: dict[str, dict], command: str, began: float) -> dict[str, list[dict]]:
    """``--runs`` rounds of the rows, rotated; the JSON rewritten after each row."""
    args = parent.args
    results: dict[str, list[dict]] = {}
    for run in range(args.runs):
        for position, name in rotated(names, run):
            key = name if name not in names[:position] else f"{name} (end of run)"
            record = parent.row(METHODS[name.split(" ")[0]], run, variants.get(name))
            results.setdefault(key, []).append(record)
            said = (
                f"{record['seconds']:.2f} s"
                if record.get("status") == "ran"
                else f"{record.get('status')}: {record.get('reason') or record.get('error')}"
            )
            print(f"[{time.monotonic() - began:6.1f} s] run {run + 1}/{args.runs} {key}: {said}", flush=True)
            if args.json:  # so far: a device call cut short still leaves the rows it measured
                result = record_of(parent, results, command, time.monotonic() - began)
                Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")
    return results


if __name__ == "__main__":
    sys.exit(main())
