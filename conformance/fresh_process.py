"""The kit's load in a fresh process with another string-hash seed: what no check inside one process can see.

Every other load the kit makes runs in the pytest process, so post-processing that
depends on the process (``hash()`` of a string, ``id()``, the order of a set,
unseeded randomness) gives the same bytes every time there, and different ones in
the next engine, which then attaches weights its own disk load would not give.

The kit therefore starts ``python -m weightcache.conformance.fresh_process DIR``
with ``PYTHONHASHSEED`` set to another seed than its own, on the same device, when a
class of its checks begins (its start overlaps the other checks): the child loads
the model from disk (mode ``off``, what it would publish) and computes the
fingerprint; when the check runs, it runs the forward on the kit's example inputs
and writes all of it to ``DIR``. Two such processes run, each with another seed; the second
loads with another thread count (``torch.set_num_threads``, ``OMP_NUM_THREADS``): post-processing
chunked by the thread count gives other bytes there. Its forward runs at the kit's thread count,
as torch's own kernels round by their chunks. The kit requires the same fingerprint, the same bytes for every tensor
of its published entry, and bit-identical outputs.

The child finds the adapter as the kit's process did: the installed entry points,
or, when the kit's ``plugins`` fixture registered it in-process, by importing the
registered module or class (``module:qualname``) with the kit's ``sys.path``; and it
calls the model through ``run_model`` when that is an importable function, else
through ``run_with_inputs`` (the default ``run_model``).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import typing
from pathlib import Path

import attrs

if typing.TYPE_CHECKING:
    from weightcache.conformance.assertions import TensorFacts
    from weightcache.core.flow.plugins import Plugins
    from weightcache.core.request import LoadRequest

TIMEOUT_S = 1800.0
"""How long the fresh process may take to import, load and run the model."""

CHECKS = ("test_fresh_process_publishes_the_same_model", "test_load_reads_only_declared_files")
"""The kit's checks that read the fresh processes (their class starts the processes early only when one will run)."""
CHECK = CHECKS[0]

HASH_PROBE = "weightcache conformance hash probe"
"""A string both processes hash: equal hashes would mean the child did not get another seed."""

SPEC, RESULT, INPUTS, OUTPUTS = "spec.json", "result.json", "inputs.pt", "outputs.safetensors"
GO = "forward\n"
"""What the kit writes to the fresh process's stdin once the inputs are saved (an empty line: no forward)."""


@attrs.frozen
class FreshLoad:
    """What the fresh process reports: its seed, its fingerprint, its tensors' facts and its outputs."""

    seed: str
    hash_probe: int
    fingerprint: dict
    tensors: dict[str, list]  # name -> [kind, dtype, shape, sha256]
    outputs: dict = attrs.field(eq=False)
    forward_error: str | None = None
    threads: int = 0
    read: list[str] = attrs.field(factory=list, eq=False)
    """The files under the checkpoint the process opened (``weightcache.conformance.file_reads``), relative to it."""
    declared: list[str] = attrs.field(factory=list, eq=False)
    """The files the adapter declares (``weightcache_checkpoint_files``), relative to the checkpoint."""
    manifest_extra: dict = attrs.field(factory=dict, eq=False)
    """What the adapter would publish as the manifest's extra state (``weightcache_manifest_extra``)."""

    @property
    def how(self) -> str:
        """How this process differed from the kit's: its hash seed and thread count."""
        return f"PYTHONHASHSEED={self.seed}, {self.threads} threads"


def importable_name(value: object) -> str | None:
    """``module:qualname`` under which ``value`` (a module, class or function) can be imported again, else None."""
    if isinstance(value, type(sys)):
        return value.__name__
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if not module or not qualname or "<" in qualname or module == "__main__":
        return None
    try:
        found: typing.Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        return None
    return f"{module}:{qualname}" if found is value else None


def import_name(name: str) -> typing.Any:
    """What :func:`importable_name` named."""
    from weightcache.core import entry_points

    return entry_points.load(name)


def adapter_spec(plugins: "Plugins | None", adapter: str) -> str | None:
    """How the child finds ``adapter``: None for the installed entry points, else the registered object's import name.

    Raises ValueError when the kit's ``plugins`` registered something the child cannot import.
    """
    if plugins is None:
        return None
    registered = plugins.pm.get_plugin(adapter)
    name = importable_name(registered)
    if name is None:
        raise ValueError(
            f"the kit's plugins fixture registered adapter {adapter!r} as {registered!r}, which a fresh process cannot "
            "import; register a module or a module-level class (Plugins.from_modules), or install its entry point"
        )
    return name


def plain(value: typing.Any) -> typing.Any:
    """``value`` with every mapping a dict and every list or tuple a plain one (what ``torch.load(weights_only=True)`` reads)."""
    if isinstance(value, typing.Mapping):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain(item) for item in value) if type(value) in (list, tuple) else [plain(item) for item in value]
    return value


def child_seed(step: int = 1) -> str:
    """A ``PYTHONHASHSEED`` other than this process's (``step`` after it when it is fixed, else ``step``)."""
    own = os.environ.get("PYTHONHASHSEED", "")
    return str((int(own) + step) % 2**32) if own.isdigit() else str(step)


def other_threads() -> int:
    """A torch thread count other than this process's: 1, or 2 where this process runs with 1."""
    import torch

    return 2 if torch.get_num_threads() == 1 else 1


def _own_threads() -> int:
    import torch

    return torch.get_num_threads()


def variants() -> list[tuple[str, int | None]]:
    """The fresh processes the kit starts: (hash seed, thread count; None: torch's default), two seeds, two thread counts."""
    return [(child_seed(1), None), (child_seed(2), other_threads())]


@attrs.define
class FreshProcess:
    """A fresh process loading the model in the background; :meth:`finish` hands it the inputs and reads what it saw.

    It starts when a class of the kit begins, so that its interpreter start (torch's import, most of its cost)
    overlaps the other checks; it loads, then waits on its stdin for the go to run the forward.
    """

    proc: subprocess.Popen = attrs.field(repr=False)
    workdir: Path
    seed: str
    _result: FreshLoad | None = attrs.field(default=None, init=False, repr=False)

    @classmethod
    def start(
        cls,
        request: "LoadRequest",
        plugins: "Plugins | None",
        run_model: typing.Callable,
        workdir: Path,
        seed: str | None = None,
        threads: int | None = None,
    ) -> "FreshProcess":
        """Start loading ``request`` from disk in a fresh process with another hash seed (``seed``, default
        ``child_seed()``) and, given ``threads``, that many threads (``torch.set_num_threads``, ``OMP_NUM_THREADS``)."""
        workdir.mkdir(parents=True, exist_ok=True)
        spec = {
            "request": {
                "model": request.model,
                "adapter": request.adapter,
                "dtype": request.dtype,
                "device": str(request.device),
                "quantization": request.quantization,
                "options": dict(request.options),
                "revision": request.revision,
                "parallel": attrs.asdict(request.parallel),
            },
            "adapter_module": adapter_spec(plugins, request.adapter),
            "run_model": importable_name(run_model),
            "threads": threads,
            "forward_threads": _own_threads(),
        }
        (workdir / SPEC).write_text(json.dumps(spec))
        seed = seed or child_seed()
        path = [entry for entry in sys.path if entry] + [os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": os.pathsep.join(entry for entry in path if entry)}
        if threads is not None:
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
        argv = [sys.executable, "-m", "weightcache.conformance.fresh_process", str(workdir)]
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        return cls(proc, workdir, seed)

    def finish(self, inputs: typing.Any) -> FreshLoad:
        """Run the forward on ``inputs`` (none for ForwardUnavailable) and return what the process saw; AssertionError if it
        failed. A second call returns the first one's result."""
        if self._result is None:
            self._result = self._finish(inputs)
        return self._result

    def _finish(self, inputs: typing.Any) -> FreshLoad:
        import torch

        from weightcache.core.request import ForwardUnavailable

        forward = not isinstance(inputs, ForwardUnavailable)
        if forward:
            torch.save(plain(inputs), self.workdir / INPUTS)
        try:
            stdout, stderr = self.proc.communicate(GO if forward else "\n", timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.close()
            raise AssertionError(f"the fresh process (PYTHONHASHSEED={self.seed}) took over {TIMEOUT_S:.0f} s") from None
        if self.proc.returncode != 0 or not (self.workdir / RESULT).exists():
            raise AssertionError(
                f"the fresh process (PYTHONHASHSEED={self.seed}) could not load the model (exit {self.proc.returncode}): "
                f"{failure_lines(stderr or stdout)}"
            )
        result = json.loads((self.workdir / RESULT).read_text())
        outputs: dict = {}
        if (self.workdir / OUTPUTS).exists():
            import safetensors.torch

            outputs = safetensors.torch.load_file(str(self.workdir / OUTPUTS))
        return FreshLoad(seed=self.seed, outputs=outputs, **result)

    def close(self) -> None:
        """Stop the process if it still runs (a class that never reached its check)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


def first_differing_tensor(fresh: FreshLoad, published: "typing.Mapping[str, TensorFacts]") -> list[str]:
    """The tensors whose kind, dtype, shape or bytes differ between the fresh load and the published entry, first by name first."""
    problems = []
    for name in sorted(set(published) | set(fresh.tensors)):
        mine, theirs = published.get(name), fresh.tensors.get(name)
        if mine is None or theirs is None:
            where = "the published entry" if mine is None else "the fresh process's load"
            problems.append(f"{name} is missing from {where}")
            continue
        kind, dtype, shape, digest = theirs
        ours = [mine.kind, mine.dtype, list(mine.shape), mine.digest]
        if ours != [kind, dtype, shape, digest]:
            what = [label for label, a, b in zip(("kind", "dtype", "shape", "bytes"), ours, theirs, strict=True) if a != b]
            problems.append(f"{name} ({mine.dtype} on {mine.device}): {', '.join(what)} differ")
    return problems


def failure_lines(text: str, count: int = 6) -> str:
    """The end of a child's output, one line, with the module an import failure names first (its traceback's last
    frames are importlib's own, ``_bootstrap._gcd_import``, which say nothing)."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    starts = ("weightcache conformance:", "ModuleNotFoundError", "ImportError")
    error = next((line for line in reversed(lines) if line.startswith(starts)), None)
    tail = " | ".join(lines[-count:])
    return f"{error} | {tail}" if error and error not in lines[-1:] else tail


def main(workdir: str) -> None:
    """The child: load as ``SPEC`` says, then write ``RESULT`` (and ``OUTPUTS``) into ``workdir``."""
    import safetensors.torch
    import torch

    from weightcache.conformance.assertions import flatten_outputs, model_tensors
    from weightcache.conformance.file_reads import FileReads, declared_names
    from weightcache.conformance.kit_loads import fresh, load
    from weightcache.core.fingerprint import ParallelSpec
    from weightcache.core.flow.example_inputs import run_with_inputs
    from weightcache.core.flow.loader import prepare
    from weightcache.core.flow.plugins import Plugins
    from weightcache.core.identity import hub
    from weightcache.core.request import LoadRequest

    directory = Path(workdir)
    spec = json.loads((directory / SPEC).read_text())
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    fields = dict(spec["request"])
    request = LoadRequest(**{**fields, "parallel": ParallelSpec(**fields["parallel"])})
    # Before the adapter or its framework imports safetensors' safe_open: every read from here on is recorded.
    reads = FileReads(hub.resolve(request.model, request.revision).path).install()
    module = spec["adapter_module"]
    plugins = Plugins.from_modules({request.adapter: _import_adapter(module)}) if module else None
    prepared = prepare(fresh(request), plugins)
    fingerprint = prepared.fingerprint
    loaded = load(request, "off", plugins)
    facts = model_tensors(loaded.model)
    result: dict[str, typing.Any] = {
        "hash_probe": hash(HASH_PROBE),
        "fingerprint": fingerprint.to_json(),
        "tensors": {name: [f.kind, f.dtype, list(f.shape), f.digest] for name, f in facts.items()},
        "forward_error": None,
        "threads": torch.get_num_threads(),
        "declared": sorted(declared_names(prepared.request.model, prepared.declared.files(prepared.request.model))),
        "manifest_extra": prepared.adapter.manifest_extra(prepared.request, loaded.model),
    }
    if sys.stdin.readline() == GO:
        # The load (post-processing) ran at the other thread count; the forward runs at the kit's: torch's own kernels
        # (a reduction, a softmax) round by their chunks, so only then do outputs compare bit for bit.
        torch.set_num_threads(spec.get("forward_threads") or torch.get_num_threads())
        inputs = torch.load(directory / INPUTS, weights_only=True)
        device = request.device
        call = import_name(spec["run_model"]) if spec["run_model"] else (lambda m, i: run_with_inputs(m, i, device))
        try:
            outputs = flatten_outputs(call(loaded.model, inputs))
        except Exception as exc:
            result["forward_error"] = f"{type(exc).__name__}: {exc}"
        else:
            safetensors.torch.save_file(
                {name: tensor.detach().to("cpu").contiguous() for name, tensor in outputs.items()}, str(directory / OUTPUTS)
            )
    result["read"] = reads.read(prepared.request.model)
    (directory / RESULT).write_text(json.dumps(result))


def _import_adapter(name: str) -> typing.Any:
    """The adapter ``name`` names; an import failure says which module and why, in one line."""
    try:
        return import_name(name)
    except ImportError as exc:
        raise SystemExit(
            f"weightcache conformance: the adapter module {name!r} does not import in a fresh process: {type(exc).__name__}: "
            f"{exc} (is its folder on sys.path or PYTHONPATH, or the package installed?)"
        ) from None


if __name__ == "__main__":
    main(sys.argv[1])
