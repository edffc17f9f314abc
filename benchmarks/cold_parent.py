"""benchmarks/cold.py's parent: each row in a fresh process after the page cache is dropped, the whole CLI under a
pseudo-terminal split into phases at its notes."""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
import shutil
import site
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import restart  # benchmarks/restart.py: the Qwen3 sizes and builder, the child environment, page-cache helpers
from cold_checkpoint import read_entries, tensorizer_path, this_script
from cold_child import tail
from cold_methods import PIECE_BYTES, SLLM_STORE_REASON, Method


def rotated(names: list[str], run: int) -> list[tuple[int, str]]:
    """``(position, name)`` in run ``run``'s order: the rows rotated by the run's number, so no method is always first
    after the checkpoint was written; a bracketing row at the end (raw-direct again) stays last."""
    numbered = list(enumerate(names))
    closing = [numbered.pop()] if len(names) > 2 and names[-1] in names[:-1] else []
    shift = run % len(numbered) if numbered else 0
    return numbered[shift:] + numbered[:shift] + closing


def prime_disk(paths: list[Path]) -> float:
    """Read every file once with O_DIRECT (buffered where refused), untimed: a VM's virtual disk may hold freshly
    written bytes in its host's cache, which no drop inside the guest reaches; after one full read every row finds
    the disk in the same state. Returns the seconds it took."""
    start = time.monotonic()
    buffer = mmap.mmap(-1, PIECE_BYTES)  # page-aligned, as O_DIRECT needs
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
        except OSError:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            offset = 0
            while got := os.preadv(fd, [buffer], offset):
                offset += got
        finally:
            os.close(fd)
    buffer.close()
    return time.monotonic() - start


def drop_page_cache(paths: list[Path], rewarm: list[str] | None = None, env: dict | None = None) -> dict:
    """``sync; echo 3 > /proc/sys/vm/drop_caches``, else fadvise(DONTNEED) per file; then what ``mincore`` finds resident.

    ``rewarm``: a command run after a whole-cache drop (it imports the libraries again, not the checkpoint),
    for rows whose clock includes the imports: a node loading a new model has used its Python libraries before.
    """
    os.sync()
    how = "drop_caches"
    try:
        with open("/proc/sys/vm/drop_caches", "w") as handle:
            handle.write("3\n")
    except OSError as exc:
        how = f"fadvise (drop_caches refused: {exc.strerror or exc})"
        restart.drop_from_page_cache(paths)
    rewarmed = None
    if rewarm and how == "drop_caches":
        start = time.monotonic()
        subprocess.run(rewarm, env=env, check=True, capture_output=True, timeout=300)
        rewarmed = round(time.monotonic() - start, 2)
    try:
        resident = restart.resident_fraction(paths)
    except OSError:
        resident = None
    return {"how": how, "resident": resident, "libraries_rewarmed_s": rewarmed}


def cache_cell(cache: dict | None) -> str:
    if cache is None:
        return ""
    resident = cache["resident"]
    if resident is None:
        return "unknown"
    if resident > 0.01:
        return f"WARM {resident:.0%}"
    return "dropped" if cache["how"] == "drop_caches" else "fadvise"


def cuda_libraries(directory: Path, cuda: str | None) -> tuple[dict, list[str]]:
    """Link libcudart.so and libcufile.so.0 from the nvidia-* wheels into ``directory`` (fastsafetensors dlopens those names).

    Where several CUDA majors are installed, the one torch was built with (``cuda``, e.g. ``13.0``) wins.
    """
    roots = [Path(p) for p in {*site.getsitepackages(), site.getusersitepackages(), *sys.path} if p and Path(p).is_dir()]
    major = f".so.{cuda.split('.')[0]}" if cuda else None
    notes = []
    for link, pattern in (("libcudart.so", "libcudart.so*"), ("libcufile.so.0", "libcufile.so*")):
        found = sorted({hit.resolve() for root in roots for hit in (root / "nvidia").glob(f"**/{pattern}")})
        found = [hit for hit in found if major and major in hit.name] or found
        if not found:
            notes.append(f"no {pattern} under nvidia/ in site-packages")
            continue
        directory.mkdir(parents=True, exist_ok=True)
        (directory / link).unlink(missing_ok=True)
        (directory / link).symlink_to(found[-1])
        notes.append(f"{link} -> {found[-1]}")
    env = {"LD_LIBRARY_PATH": os.pathsep.join(filter(None, [str(directory), os.environ.get("LD_LIBRARY_PATH")]))}
    return env, notes


class Parent:
    """Runs each row in a fresh process, one after the other, and keeps what they report."""

    def __init__(self, args, model: Path, env: dict, work: Path):
        self.args = args
        self.facts = restart.machine(args.device, env)
        self.skips: dict[str, str] = {}
        self.model = model
        self.env = env
        self.work = work
        self.files = restart.checkpoint_files(model)
        self.entries = read_entries([str(f) for f in self.files])
        self.nbytes = sum(e.end - e.begin for e in self.entries)
        self.reference_file: Path | None = None
        self.holder: subprocess.Popen | None = None
        self.stores: dict[str, Path] = {}
        self.extra_env: dict[str, dict] = {}
        self.extra_notes: dict[str, list[str]] = {}
        self.cache_paths = list(self.files)

    # the reference on the GPU, shared by every row
    def start_reference(self) -> None:
        if not self.args.device.startswith("cuda"):
            return
        self.reference_file = self.work / "reference.pickle"
        command = [*this_script(), "--role", "reference", "--model", str(self.model), "--device", self.args.device]
        self.holder = subprocess.Popen(
            [*command, "--reference", str(self.reference_file)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=self.env,
        )
        line = self.holder.stdout.readline()
        if not line:
            print(f"the reference process exited ({self.holder.wait()}); every row reloads the reference itself", flush=True)
            self.reference_file = None

    def stop_reference(self) -> None:
        if self.holder is not None:
            with contextlib.suppress(OSError):
                self.holder.stdin.close()
            try:
                self.holder.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.holder.kill()
                self.holder.wait()

    def prepare_tensorizer(self) -> str | None:
        """Convert the checkpoint for tensorizer (untimed); None, or why the row is skipped."""
        record = self.spawn(["--role", "convert"], timeout=self.args.row_timeout * 2)
        if record.get("status") == "converted":
            self.cache_paths.append(tensorizer_path(self.model))
            self.extra_notes["tensorizer"] = [f"converted untimed in {record['seconds']:.1f} s"] if "seconds" in record else []
            return None
        return record.get("reason") or record.get("error") or "the conversion failed"

    def prepare_fastsafetensors(self) -> None:
        env, notes = cuda_libraries(self.work / "cuda-libs", self.facts.get("cuda"))
        self.extra_env["fastsafetensors"] = env
        self.extra_notes["fastsafetensors"] = notes

    def store_for(self, method: Method, run: int) -> Path:
        """An empty digest store (first sight), or the remembered one (copied from a first-sight run, else filled untimed)."""
        if method.store == "empty":
            path = Path(tempfile.mkdtemp(prefix=f"digests-{method.name}-{run}-", dir=self.work))  # a variant's row too
            self.stores["last-first-sight"] = path
            return path
        if method.store == "layout":  # no digest, but the model's layout (a fine-tune of an architecture seen before)
            learned = self.stores.get("last-first-sight")
            layouts = sorted(learned.glob("layout-*.json")) if learned else []
            if not layouts:
                raise RuntimeError(f"{method.name} needs a first-sight row (wc-cli, wc-publish-first) to run before it")
            path = Path(tempfile.mkdtemp(prefix=f"digests-{method.name}-{run}-", dir=self.work))
            for layout in layouts:
                shutil.copy2(layout, path / layout.name)
            return path
        remembered = self.work / "digests-remembered"
        if not remembered.exists():
            if "last-first-sight" in self.stores:
                shutil.copytree(self.stores["last-first-sight"], remembered)
            else:
                remembered.mkdir(mode=0o700)
                record = self.spawn(["--role", "remember"], env={"WEIGHTCACHE_CACHE_DIR": str(remembered)})
                if record.get("status") != "remembered":
                    raise RuntimeError(f"could not fill the digest store: {record.get('error', record)}")
        return remembered

    def spawn(self, extra: list[str], env: dict | None = None, timeout: float | None = None) -> dict:
        """A fresh process of this script; its report is its last stdout line (an error record if it has none)."""
        command = [
            *this_script(),
            *extra,
            "--model",
            str(self.model),
            "--device",
            self.args.device,
            "--threads",
            str(self.args.threads),
        ]
        if self.reference_file is not None:
            command += ["--reference", str(self.reference_file)]
        if self.args.fastsafetensors_gds:
            command.append("--fastsafetensors-gds")
        try:
            proc = subprocess.run(
                command, env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=timeout or self.args.row_timeout
            )
        except subprocess.TimeoutExpired as exc:
            return {"status": "error", "error": f"timed out after {exc.timeout:.0f} s", "stderr": tail(exc.stderr)}
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode == 0 and lines:
            return json.loads(lines[-1])
        return {"status": "error", "error": f"exit status {proc.returncode}", "stderr": tail(proc.stderr)}

    def row(self, method: Method, run: int, variant_env: dict | None = None) -> dict:
        """One run of one method (with ``variant_env`` added to its environment): drop the page cache, run it in a fresh
        process, and return what it reported."""
        if method.kind == "none":
            return {"status": "not run", "reason": self.sllm_reason()}
        if method.needs_cuda and not self.args.device.startswith("cuda"):
            return {"status": "skipped", "reason": f"{method.name} loads to CUDA devices only"}
        if method.name in self.skips:
            return {"status": "skipped", "reason": self.skips[method.name]}
        env = {**self.extra_env.get(method.name, {}), **(variant_env or {})}
        server = None
        try:
            if method.store:
                env["WEIGHTCACHE_CACHE_DIR"] = str(self.store_for(method, run))
            if method.server:
                from weightcache.core.server.server_process import ServerProcess

                server = ServerProcess.start()
            extra = ["--socket-dir", str(server.socket_dir)] if server else []
            rewarm = self.rewarm_command() if method.kind == "cli" else None
            cache = drop_page_cache(self.cache_paths, rewarm, self.env)
            if method.kind == "cli":
                record = self.cli_row(env, server.socket_dir)
            else:
                record = self.spawn(["--role", "child", "--method", method.name, *extra], env=env)
            record["cache"] = cache
            if cache["libraries_rewarmed_s"] is not None:
                record.setdefault("notes", []).append("Python libraries re-read after the drop, untimed (checkpoint cold)")
        except Exception as exc:  # one broken row must not lose the others
            record = {"status": "error", "error": f"{type(exc).__name__}: {exc}", "stderr": tail(traceback.format_exc())}
        finally:
            if server is not None:
                server.close()
        record.setdefault("notes", [])
        record["notes"] = self.extra_notes.get(method.name, []) + record["notes"]
        return record

    def cli_row(self, env: dict, socket_dir: Path) -> dict:
        """``weightcache load`` from exec to exit under a pseudo-terminal (its notes give the phases), then attach to check."""
        verbose = ["-v"] if self.args.cli_verbose else []
        command = [
            sys.executable,
            "-m",
            "weightcache.core.cli.cli",
            *verbose,
            "load",
            "--model",
            str(self.model),
            "--dtype",
            "bfloat16",
        ]
        command += ["--device", self.args.device, "--socket-dir", str(socket_dir)]
        status, wall, lines = run_on_terminal(command, {**self.env, **env, "COLUMNS": "120"}, self.args.row_timeout)
        text = [line for _, line in lines]
        if status != 0:
            return {"status": "error", "error": f"weightcache load exited with {status}", "stderr": tail("\n".join(text))}
        record = {"status": "ran", "seconds": wall, "phases": cli_phases(lines, wall), "output": text[-5:]}
        record["notes"] = [phase_text(record["phases"])]
        if verbose:
            record["timeline"] = [f"{seconds:7.2f} {line[:200]}" for seconds, line in lines[:400]]
        check = self.spawn(["--role", "child", "--method", "wc-entry", "--socket-dir", str(socket_dir)], env=env)
        record["verify"] = check.get("verify") or {
            "ok": False,
            "error": check.get("error") or check.get("reason"),
            "stderr": check.get("stderr"),
        }
        return record

    def rewarm_command(self) -> list[str]:
        """Import what ``weightcache load`` imports (torch, transformers, safetensors, weightcache and its adapters)."""
        code = "import torch, transformers, safetensors, weightcache.core.cli.cli, weightcache.core.flow.loader\n"
        code += "from weightcache.core.flow.plugins import installed_plugins; installed_plugins()\n"
        # What transformers imports to read this model's config and build its class (its config.json only: ~2,350
        # modules more on the H200 machine, pandas, scipy.stats and torch._dynamo among them).
        code += f"config = transformers.AutoConfig.from_pretrained({str(self.model)!r})\n"
        code += "getattr(transformers, config.architectures[0])\n"
        if self.args.device.startswith("cuda"):
            code += f"torch.empty(1, device={self.args.device!r})\n"
        return [sys.executable, "-c", code]

    def sllm_reason(self) -> str:
        facts = self.facts
        return SLLM_STORE_REASON.format(python=facts.get("python", "?"), torch=facts.get("torch", "?"))


def run_on_terminal(command: list[str], env: dict, timeout: float) -> tuple[int, float, list[tuple[float, str]]]:
    """Run ``command`` with stdout and stderr on a pseudo-terminal; its exit status, wall seconds and each line's arrival time."""
    import pty
    import select

    master, slave = pty.openpty()
    start = time.monotonic()
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    lines: list[tuple[float, str]] = []
    pending = b""
    try:
        while True:
            if time.monotonic() - start > timeout:
                proc.kill()
                break
            ready, _, _ = select.select([master], [], [], 0.5)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, 1 << 16)
            except OSError:  # EIO: the terminal's other side is closed
                break
            if not data:
                break
            now = time.monotonic() - start
            *complete, pending = re.split(rb"[\r\n]", pending + data)
            lines += [(now, text) for text in map(_clean, complete) if text]
        status = proc.wait()
        wall = time.monotonic() - start
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if _clean(pending):
        lines.append((wall, _clean(pending)))
    return status, wall, lines


def _clean(raw: bytes) -> str:
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", raw.decode(errors="replace")).strip()


def cli_phases(lines: list[tuple[float, str]], wall: float) -> dict:
    """Split ``weightcache load``'s wall clock at its notes: checking, hashing (first sight only), loading, published."""

    def first(prefix: str) -> float | None:
        return next((t for t, text in lines if text.startswith(prefix)), None)

    checking, hashing, loading = first("checking "), first("hashing "), first("loading ")
    published = first("published ") or first("already cached")
    work = hashing if hashing is not None else loading
    phases = {
        "first_output_s": checking,
        "start_and_checks_s": work,
        "hashing_s": loading - hashing if hashing is not None and loading is not None else None,
        "read_and_publish_s": published - loading if published is not None and loading is not None else None,
        "exit_s": wall - published if published is not None else None,
    }
    said = next((text for _, text in lines if text.startswith("published ")), "")
    reported = re.search(r"([0-9.]+) s\b", said)
    phases["cli_reported_s"] = float(reported.group(1)) if reported else None
    return phases


def phase_text(phases: dict) -> str:
    names = (
        ("start_and_checks_s", "imports+checks"),
        ("hashing_s", "hashing"),
        ("read_and_publish_s", "read+publish"),
        ("exit_s", "exit"),
    )
    return (
        ", ".join(f"{label} {phases[key]:.2f}" for key, label in names if phases.get(key) is not None)
        or "no phases (notes not seen)"
    )
