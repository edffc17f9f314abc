"""A warm spare: an engine process that has paid for its start before it is needed (``weightcache standby``).

    weightcache standby --model DIR [--device D] [--socket-dir S] [--adapter A] [--dtype T]
                        [--watch-pid PID] [--then MODULE:FUNCTION]

It does ahead of time what a restarted engine waits for: the imports (the
adapter's ``weightcache_warm_up`` hook), the CUDA context (started early, so it
overlaps the imports), the model skeleton, the attach (``client`` mode, strict:
it maps the server's entry and holds no copy of its own; a standby that cannot
attach says why and exits with status 1) and one warm-up forward. Then it
waits, and takes over on the first of:

- the watched primary (``--watch-pid``) exits, however it exits: its exit has
  begun (``/proc/PID/stat`` read every millisecond: ``PF_EXITING`` or no memory
  map left), or it is a zombie (seen by that poll, and by a pidfd where the
  kernel has one; ``--no-pidfd`` or ``WEIGHTCACHE_STANDBY_PIDFD=0``: the poll alone);
- SIGUSR1;
- a line ``takeover`` on its standard input.

On take-over it calls ``FUNCTION(loaded)`` (``--then``; an int it returns is
the exit status), or by default generates one token from a fixed prompt and
reports the first-token latency since the trigger. Standard output carries one
JSON line when the standby is ready (``"event": "ready"``) and one when it took
over (``"event": "took_over"``); logs go to standard error.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import select
import signal
import sys
import threading
import time
import typing
from collections.abc import Iterable

import attrs

from weightcache.core import envvars
from weightcache.core.cli.cli_options import add_timeout, help_text
from weightcache.core.errors import StandbyError, WeightCacheError
from weightcache.core.flow.example_inputs import run_with_inputs, to_device
from weightcache.core.progress import format_bytes
from weightcache.core.request import ExampleInputs, ForwardUnavailable, LoadRequest
from weightcache.core.socket_dir import SocketDir, SocketDirLike

if typing.TYPE_CHECKING:
    import torch

    from weightcache.core.arena.base import Arena
    from weightcache.core.flow.modes import LoadedModel
    from weightcache.core.flow.plugins import Plugins

log = logging.getLogger(__name__)

TAKEOVER_REQUEST = "takeover"
POLL_INTERVAL_S = 0.001
"""How often a watched primary's ``/proc/PID/stat`` is read, pidfd or not (one read, ~20 µs: ~2 % of one core)."""
PF_EXITING = 0x4
"""``/proc/PID/stat`` flag of a task whose exit has begun (``linux/sched.h``): set the moment a SIGKILL is acted on,
long before a primary holding GPU memory has torn its mappings down and become a zombie."""


@attrs.frozen
class Trigger:
    """Why and when (``time.monotonic()``) a standby took over: ``primary_exited``, ``signal`` or ``request``."""

    reason: str
    at: float
    detail: str = ""


@attrs.frozen
class TakeOver:
    """What a take-over did: the trigger, and the first token and when it came (default action) or what ``then`` returned."""

    trigger: Trigger
    token: int | None = None
    first_token_at: float | None = None
    result: typing.Any = None

    def to_json(self) -> dict:
        report = {
            "event": "took_over",
            "reason": self.trigger.reason,
            "detail": self.trigger.detail,
            "pid": os.getpid(),
            "trigger_at": self.trigger.at,
        }
        if self.first_token_at is not None:
            report.update(
                token=self.token,
                first_token_at=self.first_token_at,
                first_token_ms=(self.first_token_at - self.trigger.at) * 1000,
            )
        return report


class Standby:
    """A warm spare for one model rank: ``start()``, then ``wait()``, then ``take_over()`` (see the module docstring).

    :param request: the model to attach (the adapter's own options included).
    :param socket_dir: the server's socket directory.
    :param watch_pid: a primary to take over from when it exits (watched from ``start()`` on).
    :param then: called with the LoadedModel on take-over, instead of generating one token.
    :param requests: a file whose ``takeover`` lines trigger a take-over (the command passes standard input).
    """

    def __init__(
        self,
        request: LoadRequest,
        *,
        socket_dir: SocketDirLike = None,
        watch_pid: int | None = None,
        then: "typing.Callable[[LoadedModel], typing.Any] | None" = None,
        requests: typing.IO | None = None,
        timeout_s: float = 30.0,
        plugins: "Plugins | None" = None,
        use_pidfd: bool = True,
    ):
        self.request = request
        self.socket_dir = SocketDir.parse(socket_dir)
        self.watch_pid = watch_pid
        self.use_pidfd = use_pidfd
        self.then = then
        self.requests = requests
        self.timeout_s = timeout_s
        self.plugins = plugins
        self.loaded: LoadedModel | None = None
        self.inputs: typing.Any = None  # the fixed prompt's inputs, once start() built them
        self.timings: dict[str, float] = {}
        self._triggers: _Triggers | None = None

    @classmethod
    def for_model(
        cls, model: str, *, adapter: str = "hf", device: str = "cpu", dtype: str | None = None, **kwargs: typing.Any
    ) -> "Standby":
        """A standby for ``model``; ``kwargs`` are this class's keyword parameters."""
        return cls(LoadRequest(model=model, adapter=adapter, device=device, dtype=dtype), **kwargs)

    def start(self) -> dict:
        """Import, create the CUDA context, attach, warm up; returns the ``ready`` report. StandbyError if it cannot attach."""
        from weightcache.core.flow.modes import CacheOptions, run
        from weightcache.core.flow.plugins import installed_plugins
        from weightcache.core.spare.warm import start_cuda_early

        began = time.perf_counter()
        # Before anything slow: a primary that dies meanwhile counts.
        triggers = self._triggers = _Triggers(self.watch_pid, self.requests, use_pidfd=self.use_pidfd)
        cuda = start_cuda_early(self.request.device)
        adapter = (self.plugins or installed_plugins()).adapter(self.request.adapter)
        adapter.warm_up(self.request)
        self.timings["imports_s"] = time.perf_counter() - began
        self.timings["cuda_wait_s"] = cuda.wait()
        private_before = rss_anon_bytes()  # after the imports: what follows would hold a copy of the weights, if anything
        start = time.perf_counter()
        cache = CacheOptions(mode="client", socket_dir=self.socket_dir, strict=True, timeout_s=self.timeout_s)
        try:
            loaded = self.loaded = run(self.request, cache, plugins=self.plugins)
        except WeightCacheError as exc:
            raise StandbyError(
                f"the standby for {self.request.model} cannot attach: {exc}. A standby maps the server's entry and holds "
                "no copy of its own: publish the model first (`weightcache load --model ...`, or an engine in daemon mode)"
            ) from None
        self.timings["load_s"] = time.perf_counter() - start  # prepare + attach + rebind (each in the report too)
        start = time.perf_counter()
        inputs = fixed_prompt(self.request, loaded.model, self.plugins)
        if isinstance(inputs, ForwardUnavailable):
            if self.then is None:
                raise StandbyError(
                    f"the standby cannot generate a token with this model ({inputs.reason}); pass --then MODULE:FUNCTION"
                )
            log.info("no warm-up forward: %s", inputs.reason)
        else:
            self.inputs = inputs
            first_token(loaded.model, self.inputs)
        self.timings["warm_up_s"] = time.perf_counter() - start
        attachment = loaded.attachment
        if attachment is None:  # strict client mode attaches or raises
            raise StandbyError(f"the standby for {self.request.model} holds no attached entry")
        report = {
            "event": "ready",
            "pid": os.getpid(),
            "model": self.request.model,
            "device": str(self.request.device),
            "digest": attachment.digest,
            "mapped_bytes": attachment.manifest.nbytes,
            "watched_by": triggers.watched_by,
            "parameters_outside_arenas": parameters_outside(loaded.model, attachment.arenas),
            "private_growth_bytes": rss_anon_bytes() - private_before,
            "timings": (timings := {**self.timings, "ready_s": time.perf_counter() - began, **loaded.timings}),
        }
        log.info(
            "standby ready for %s in %.2f s (%s mapped, no copy)",
            self.request.model,
            timings["ready_s"],
            format_bytes(attachment.manifest.nbytes),
        )
        return report

    def wait(self, timeout: float | None = None) -> Trigger | None:
        """Block until a trigger (None after ``timeout`` seconds)."""
        if self._triggers is None:
            raise StandbyError("start() the standby before waiting")
        return self._triggers.wait(timeout)

    def take_over(self, trigger: Trigger) -> TakeOver:
        """Serve: call ``then(loaded)``, or generate one token from the fixed prompt."""
        if self._triggers is not None:
            self._triggers.close()
            self._triggers = None
        if self.loaded is None:
            raise StandbyError("start() the standby before it takes over")
        if self.then is not None:
            return TakeOver(trigger, result=self.then(self.loaded))
        token = first_token(self.loaded.model, self.inputs)
        return TakeOver(trigger, token=token, first_token_at=time.monotonic())

    def close(self) -> None:
        """Stop watching, restore SIGUSR1, detach."""
        if self._triggers is not None:
            self._triggers.close()
            self._triggers = None
        if self.loaded is not None:
            self.loaded.close()
            self.loaded = None

    def __enter__(self) -> "Standby":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def fixed_prompt(request: LoadRequest, model: "torch.nn.Module", plugins: "Plugins | None" = None) -> ExampleInputs:
    """The prompt a standby generates its first token from: the adapter's example inputs, on ``request.device``.

    ForwardUnavailable when the adapter says the model cannot run a forward here.
    """
    from weightcache.core.flow.plugins import installed_plugins

    inputs = (plugins or installed_plugins()).adapter(request.adapter).example_inputs(request, model)
    return inputs if isinstance(inputs, ForwardUnavailable) else to_device(inputs, request.device.torch())


def first_token(model: "torch.nn.Module", inputs: typing.Any) -> int:
    """One forward on ``inputs``; the index of the largest value of the first output at the last position.

    For a causal LM that is the next token of the first prompt. Reading it
    waits for the GPU, so the call's duration is the first-token latency.
    """
    import torch

    output = run_with_inputs(model, inputs)
    scores = getattr(output, "logits", None)
    if scores is None:
        scores = output if isinstance(output, torch.Tensor) else output[0]
    row = scores[0] if scores.dim() > 1 else scores  # the first prompt
    return int((row[-1] if row.dim() > 1 else row).argmax())  # at its last position


def parameters_outside(model: "torch.nn.Module", arenas: "Iterable[Arena]") -> int:
    """How many of ``model``'s parameters do not lie inside one of the mapped ``arenas`` (0: no private copy)."""
    spans = [(arena.address, arena.address + arena.spec.size) for arena in arenas]
    outside = 0
    for param in model.parameters():
        storage = param.untyped_storage()
        low = storage.data_ptr()
        high = low + storage.nbytes()
        outside += not any(start <= low and high <= end for start, end in spans)
    return outside


def rss_anon_bytes() -> int:
    """This process's private (anonymous) resident memory: weights mapped from an entry are not in it."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class _Triggers:
    """The take-over triggers, watched together with one ``poll``: a primary's exit, SIGUSR1, ``takeover`` lines."""

    def __init__(self, watch_pid: int | None, requests: typing.IO | None, use_pidfd: bool = True):
        self._use_pidfd = use_pidfd
        self.watched_by = "nothing (no --watch-pid)"
        self._poll = select.poll()
        self._pidfd = -1
        self._watch_pid = watch_pid
        self._requests_fd = -1
        self._pending = b""
        self._signal_pipe: tuple[int, int] | None = None
        self._previous: tuple | None = None
        if watch_pid is not None:
            self._watch(watch_pid)
        if requests is not None:
            self._requests_fd = requests.fileno()
            self._poll.register(self._requests_fd, select.POLLIN)
        if threading.current_thread() is threading.main_thread():
            self._catch_sigusr1()
        else:
            log.warning("standby waits outside the main thread: SIGUSR1 cannot reach it; use --watch-pid or a request")

    def _watch(self, pid: int) -> None:
        """A pidfd where the kernel has one (it wakes the wait when the primary is a zombie), and in every case
        ``/proc/PID/stat`` read every POLL_INTERVAL_S, which sees the exit begin (a pidfd only fires once a primary
        that maps GPU memory, or much host memory, has torn it all down: 0.5-1 s for 1.5 GiB of host memory here)."""
        polling = f"/proc/PID/stat every {POLL_INTERVAL_S * 1000:g} ms (exit begun: PF_EXITING or no memory map; or zombie)"
        try:
            if not self._use_pidfd:
                raise OSError("pidfds not used")
            self._pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            raise StandbyError(f"there is no process {pid} to watch; give the primary engine's pid to --watch-pid") from None
        except (AttributeError, OSError) as exc:  # no pidfd here (old kernel, sandbox or Python): the poll alone
            self.watched_by = f"polling {polling}, no pidfd ({exc})"
            log.info("watching pid %d by %s", pid, self.watched_by)
            if not _alive(pid):
                raise StandbyError(f"there is no process {pid} to watch; give the primary engine's pid to --watch-pid") from None
            return
        self.watched_by = f"pidfd and polling {polling}"
        self._poll.register(self._pidfd, select.POLLIN)

    def _catch_sigusr1(self) -> None:
        read_end, write_end = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._signal_pipe = (read_end, write_end)
        handler = signal.signal(signal.SIGUSR1, lambda *_: None)  # the byte on the wake-up fd is what counts
        self._previous = (handler, signal.set_wakeup_fd(write_end, warn_on_full_buffer=False))
        self._poll.register(read_end, select.POLLIN)

    def wait(self, timeout: float | None) -> Trigger | None:
        polling = self._watch_pid is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            step = POLL_INTERVAL_S if polling else remaining
            if polling and remaining is not None:
                step = min(POLL_INTERVAL_S, remaining)
            try:
                events = self._poll.poll(None if step is None else step * 1000)
            except InterruptedError:
                events = []
            now = time.monotonic()
            for fd, _ in events:
                trigger = self._read_event(fd, now)
                if trigger is not None:
                    return trigger
            if polling and self._watch_pid is not None and not _alive(self._watch_pid):
                return Trigger("primary_exited", time.monotonic(), f"pid {self._watch_pid}")
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def _read_event(self, fd: int, now: float) -> Trigger | None:
        if fd == self._pidfd:
            return Trigger("primary_exited", now, f"pid {self._watch_pid}")
        if self._signal_pipe is not None and fd == self._signal_pipe[0]:
            try:
                caught = os.read(fd, 512)
            except BlockingIOError:
                return None
            return Trigger("signal", now, "SIGUSR1") if signal.SIGUSR1 in caught else None
        if fd == self._requests_fd:
            data = os.read(fd, 4096)
            if not data:  # end of input: no more requests will come
                self._poll.unregister(fd)
                self._requests_fd = -1
                return None
            self._pending += data
            *lines, self._pending = self._pending.split(b"\n")
            for line in lines:
                text = line.strip().decode(errors="replace")
                if text == TAKEOVER_REQUEST:
                    return Trigger("request", now, TAKEOVER_REQUEST)
                log.warning("standby: ignoring the request %r (the one request is %r)", text[:80], TAKEOVER_REQUEST)
        return None

    def close(self) -> None:
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1
        if self._signal_pipe is not None and self._previous is not None:
            handler, wakeup = self._previous
            signal.set_wakeup_fd(wakeup)
            signal.signal(signal.SIGUSR1, handler)
            for fd in self._signal_pipe:
                os.close(fd)
            self._signal_pipe = None


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs: not gone, and :func:`exit_begun` does not say so of its ``/proc/PID/stat``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return not exit_begun(stat.read())
    except (FileNotFoundError, ProcessLookupError):
        return False


def exit_begun(stat: bytes) -> bool:
    """Whether a ``/proc/PID/stat`` line is that of a process whose exit has begun, or is over.

    Any of: the state is zombie or dead; the ``PF_EXITING`` flag (Linux sets it the moment a SIGKILL is acted on); no
    memory map (``vsize`` 0: every user process has mappings until its exit releases them). A primary killed while it
    maps GPU memory spends a long while tearing its mappings down before it turns zombie; the flag and the empty map come
    before. gVisor reports no flags (the field is always 0) and no zombie until the teardown is done: there the empty
    map is the early sign (its leader thread drops its map first). A line that cannot be read counts as exited.
    """
    try:
        fields = stat.rsplit(b")", 1)[1].split()
        return fields[0] in (b"Z", b"X", b"x") or bool(int(fields[6]) & PF_EXITING) or int(fields[20]) == 0
    except (IndexError, ValueError):
        return True


def load_function(spec: str) -> "typing.Callable":
    """The function ``MODULE:FUNCTION`` names; StandbyError says what is wrong."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise StandbyError(f"--then {spec!r}: expected MODULE:FUNCTION (e.g. my_engine.serve:run)")
    try:
        function = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise StandbyError(f"--then {spec!r}: {exc}") from None
    if not callable(function):
        raise StandbyError(f"--then {spec!r} is not callable")
    return function


# --- the `weightcache standby` command (registered under the `weightcache.commands` entry points) ---------------------


def add_parser(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "standby",
        help="a warm spare: attach, warm up, wait; take over when the primary dies",
        description=help_text(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", required=True, help="checkpoint directory (published to the server already)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or a GPU UUID (default: cpu)")
    parser.add_argument("--socket-dir", help="the server's private directory (default: weightcache's default)")
    parser.add_argument("--adapter", default="hf", help="adapter name (default: hf)")
    parser.add_argument("--dtype", help="dtype of unquantized weights, as the entry was published (default: the checkpoint's)")
    parser.add_argument("--watch-pid", type=int, metavar="PID", help="take over when this process (the primary) exits")
    parser.add_argument(
        "--no-pidfd",
        action="store_true",
        help="watch the primary by the /proc poll alone, no pidfd (also: WEIGHTCACHE_STANDBY_PIDFD=0)",
    )
    parser.add_argument(
        "--then", metavar="MODULE:FUNCTION", help="call FUNCTION(loaded) on take-over instead of generating one token"
    )
    add_timeout(parser, 30.0, "deadline of each request to the server")
    return parser


def run(args: argparse.Namespace) -> int:
    then = load_function(args.then) if args.then else None
    standby = Standby.for_model(
        args.model,
        adapter=args.adapter,
        device=args.device,
        dtype=args.dtype,
        socket_dir=args.socket_dir,
        watch_pid=args.watch_pid,
        then=then,
        requests=sys.stdin,
        timeout_s=args.timeout,
        use_pidfd=not args.no_pidfd and envvars.switch("WEIGHTCACHE_STANDBY_PIDFD") is not False,
    )
    try:
        print(json.dumps(standby.start()), flush=True)
        trigger = standby.wait()
        if trigger is None:  # no deadline: wait returns a trigger
            raise StandbyError("the standby stopped waiting without a trigger")
        if then is not None:
            print(json.dumps(TakeOver(trigger).to_json()), flush=True)
        took_over = standby.take_over(trigger)
        if then is None:
            print(json.dumps(took_over.to_json()), flush=True)
            return 0
        result = took_over.result
        return result if isinstance(result, int) and not isinstance(result, bool) else 0
    finally:
        standby.close()
