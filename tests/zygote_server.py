"""The test zygote's server: run as ``python -c <this file's text>`` by tests/zygote.py, never imported.

It imports the heavy third-party libraries once (argv[1], comma-separated; never weightcache, no torch op run),
then on each request forks a child that becomes ``python -c CODE ARGS`` or ``python -m MODULE ARGS``: argv, the
environment, cwd, umask, session, stdin/stdout/stderr and the passed fds as the request says (the fds come over the
control socket with SCM_RIGHTS), and the target runs at this module's top level, so that the interpreter finishes the
child as it finishes any ``python -c``/``-m`` (threads joined, atexit, the exit status of SystemExit or a traceback's 1,
a KeyboardInterrupt's SIGINT). The child stays unreaped until its caller has read its status and closed its channel,
so a pid the caller signals is never a recycled one (subprocess.Popen's guarantee). Single-threaded: one selector
over the control socket, the children's pidfds and channels, and the parent's pidfd (the server exits with its
parent).
"""

import os
import sys

_FRESH_MAIN = dict(globals())  # what `python -c` gives __main__ before any code of its own: the children's start
del _FRESH_MAIN["__doc__"]
_FRESH_MAIN["__doc__"] = None
if sys.path and sys.path[0] == "":
    del sys.path[0]  # the server's own '' (cwd) entry; each child gets the one its form gives
_BASE_PATH = list(sys.path)

import fcntl  # noqa: E402
import gc  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import selectors  # noqa: E402
import socket  # noqa: E402
import types  # noqa: E402
import warnings  # noqa: E402

with warnings.catch_warnings(record=True) as _warned:  # a warning a fresh child would see (or, with -W error, raise)
    warnings.simplefilter("always")
    for _name in sys.argv[1].split(",") if len(sys.argv) > 1 and sys.argv[1] else []:
        importlib.import_module(_name)
if _warned:
    sys.exit(f"the preloads warn, so their children could not start as exec'd ones: {[str(w) for w in _warned]}")
del _warned
# The imports' objects go to the collector's permanent generation: a child's collections (the one at its exit included)
# would otherwise write to every one of their pages and copy them (~1 CPU-s a child). What that changes in a child:
# those objects, all reachable now, are never collected by its cycle collector (freed as it exits, without the final
# collection of cycles among them); a fresh interpreter holds them through sys.modules to its end as well.
gc.collect()
gc.freeze()
_CONTROL_FD = int(sys.argv[2])
_MAX_MESSAGE = 1 << 20
_MAX_FDS = 64


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a zombie and of the children it waited for (/proc/PID/stat), for the suite's CPU accounting."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()
        return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return 0.0


def _serve():
    """Answer requests until the control socket closes or the parent dies; return a request in a forked child."""
    control = socket.socket(fileno=_CONTROL_FD)
    control.send(b"ready" + json.dumps(dict(os.environ)).encode())  # what the imports made of the environment
    selector = selectors.DefaultSelector()
    selector.register(control, selectors.EVENT_READ, ("control", None))
    parent = os.pidfd_open(os.getppid())
    selector.register(parent, selectors.EVENT_READ, ("parent", None))
    children = {}  # pid -> [channel, or None once the caller closed it; exited]
    while True:
        for key, _ in selector.select():
            kind, pid = key.data
            if kind == "parent":
                os._exit(0)
            if kind == "control":
                try:
                    data, fds, _flags, _addr = socket.recv_fds(control, _MAX_MESSAGE, _MAX_FDS)
                except OSError:
                    data, fds = b"", []
                if not data:
                    os._exit(0)
                request = json.loads(data)
                channel = socket.socket(fileno=fds[0])
                child = os.fork()
                if child == 0:
                    selector.close()
                    control.close()
                    os.close(parent)
                    for other, _exited in children.values():
                        if other is not None:
                            other.close()
                    return request, channel, fds[1:]
                for fd in fds[1:]:
                    os.close(fd)
                children[child] = [channel, False]
                selector.register(os.pidfd_open(child), selectors.EVENT_READ, ("exit", child))
                selector.register(channel, selectors.EVENT_READ, ("channel", child))
                channel.sendall(json.dumps({"pid": child}).encode() + b"\n")
            elif kind == "exit":
                selector.unregister(key.fd)
                result = os.waitid(os.P_PIDFD, key.fd, os.WEXITED | os.WNOWAIT)
                os.close(key.fd)
                channel = children[pid][0]
                if channel is None:  # dropped unwaited, as a garbage Popen: nobody can signal it now
                    os.waitpid(pid, 0)
                    del children[pid]
                    continue
                children[pid][1] = True
                code = result.si_status if result.si_code == os.CLD_EXITED else -result.si_status
                try:
                    channel.sendall(json.dumps({"returncode": code, "cpu": _cpu_seconds(pid)}).encode() + b"\n")
                except OSError:
                    pass
            else:  # the caller's channel: it never writes, so readable means closed: it is done with the child
                channel, exited = children[pid]
                selector.unregister(channel)
                channel.close()
                if exited:
                    os.waitpid(pid, 0)
                    del children[pid]
                else:
                    children[pid][0] = None


def _enter_netns(path: str) -> None:
    """Move this (single-threaded, just forked) child into the network namespace at ``path``."""
    import ctypes  # here: a child outside a namespace imports nothing a fresh interpreter would not

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns {path}: {os.strerror(errno)}")
    finally:
        os.close(fd)


def _become(request, channel, fds):
    """In the child: take the request's process state, tell the caller it started (or why not), return the target."""
    try:
        if request["start_new_session"]:
            os.setsid()
        if request["umask"] >= 0:
            os.umask(request["umask"])
        os.chdir(request["cwd"])
        targets = [0, 1, 2, *request["pass_fds"]]
        above = max(targets) + 1  # sources and the channel move above every target, so that no dup2 overwrites them
        moved = socket.socket(fileno=fcntl.fcntl(channel.fileno(), fcntl.F_DUPFD_CLOEXEC, above))
        channel.close()
        channel = moved
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, above) for fd in fds]
        for fd in fds:
            os.close(fd)
        for source, target in zip(high, targets, strict=True):
            os.dup2(source, target, inheritable=True)
        for source in high:
            if source not in targets:
                os.close(source)
        low = 0
        for fd in sorted({*targets, channel.fileno()}):  # close_fds: everything else goes
            if low < fd:  # os.closerange(n, n) closes from n upwards (it passes n - 1 as the inclusive end)
                os.closerange(low, fd)
            low = fd + 1
        os.closerange(low, os.sysconf("SC_OPEN_MAX"))
        os.environ.clear()
        os.environ.update(request["env"])
        if request.get("netns"):
            _enter_netns(request["netns"])
    except OSError as exc:
        channel.sendall(json.dumps({"errno": exc.errno, "error": str(exc)}).encode() + b"\n")
        os._exit(255)
    channel.sendall(b'{"started": true}\n')
    channel.close()
    if os.isatty(1):
        sys.stdout.reconfigure(line_buffering=True)  # as the interpreter makes an interactive stdout
    importlib.invalidate_caches()
    random = sys.modules.get("numpy.random")
    if random is not None:
        random.seed()  # a fresh interpreter seeds numpy's global generator from the OS; a fork would share ours
    argv = request["argv"]
    sys.orig_argv = [sys.executable, *argv]
    main = types.ModuleType("__main__")
    main.__dict__.update(_FRESH_MAIN)
    sys.modules["__main__"] = main
    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[:] = ["", *_BASE_PATH]
        try:
            code = compile(argv[1], "<string>", "exec")
        except SyntaxError as exc:  # as the interpreter reports a command it cannot compile: no traceback, exit 1
            sys.excepthook(type(exc), exc, None)
            sys.exit(1)
        return code, main.__dict__, None
    sys.argv = ["-m", *argv[2:]]
    sys.path[:] = [os.getcwd(), *_BASE_PATH]
    return None, None, argv[1]


_request, _channel, _fds = _serve()
_code, _namespace, _module = _become(_request, _channel, _fds)
if _module is None:
    exec(_code, _namespace)
else:
    import runpy

    runpy._run_module_as_main(_module, alter_argv=True)
