"""An engine's own start state, kept per identity for the next engine of that model.

What vLLM and SGLang compute at start that depends only on the model, the engine's options and the machine lands in
their own caches: vLLM's compile cache and model-info cache under ``VLLM_CACHE_ROOT`` (its compiled graphs, inductor's
and Triton's kernels: vLLM points ``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR`` below it itself), torch's
inductor and Triton caches for SGLang's ``--enable-torch-compile``. Once a load knows its entry's fingerprint, ``keep``
gives the engine a directory of that identity for them, through the engines' own settings, so the next engine of the
same model finds what the last one compiled and skips the work; another model, dtype, rank, engine release, torch or
machine gets a directory of its own. The engines' caches still check their own keys (vLLM's hash of its config and
code, inductor's of the graph) inside it.

The directory is ``<WEIGHTCACHE_CACHE_DIR's parent>/engine-state/<key digest>/`` with ``identity.json``, the key it was
made for; a directory whose record is missing or names another key is emptied before use. A setting the user chose
(``VLLM_CACHE_ROOT``, ``TORCHINDUCTOR_CACHE_DIR`` other than torch's or SGLang's default, ``SGLANG_CACHE_DIR``) is
left alone, and ``WEIGHTCACHE_ENGINE_STATE=0`` turns this off. The memory profile's result is not kept: it measures
the device's free memory, which other processes change between starts (vLLM's ``kv_cache_memory_bytes`` is the
user's own way to skip it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import sys
import typing
from pathlib import Path

import attrs

if typing.TYPE_CHECKING:
    from weightcache.adapter import Fingerprint

log = logging.getLogger(__name__)

ENV_SWITCH = "WEIGHTCACHE_ENGINE_STATE"
RECORD = "identity.json"
SETTINGS = {"vllm": ("VLLM_CACHE_ROOT",), "sglang": ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
"""Per engine: the environment settings through which it is given its state directory (read when it compiles)."""
_given: dict[str, str] = {}
"""What ``keep`` set in this process: a later load (a draft model, another identity) may set them again."""


@attrs.frozen
class StartState:
    """The state directory an engine was given: where, whether it held state of this identity, and the settings set."""

    path: Path
    reused: bool
    settings: dict[str, str]


def state_root() -> Path:
    """``engine-state`` beside the digest store (``$WEIGHTCACHE_CACHE_DIR``'s parent, else ``~/.cache/weightcache``);
    OSError where that store is not a private directory of this user (then nothing is kept there either)."""
    from weightcache.adapter import default_store

    directory = default_store().directory
    if directory is None:
        raise OSError("the digest store's directory is not trusted (see the warning above)")
    return directory.parent / "engine-state"


def state_key(fingerprint: Fingerprint, engine: str) -> dict[str, str]:
    """What the state depends on: the entry (model content, config, engine options in its key, dtype, ranks, engine
    and torch versions, GPU) and the CPU the kernels were built for."""
    return {"engine": engine, "fingerprint": fingerprint.digest, "machine": machine()}


def machine() -> str:
    """This CPU: architecture, model name and a digest of its feature flags (inductor's C++ kernels use them)."""
    name, flags = "", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not name:
                name = value.strip()
            elif key.strip() in ("flags", "Features") and not flags:
                flags = hashlib.sha256(" ".join(sorted(value.split())).encode()).hexdigest()[:16]
    except OSError:
        pass
    return f"{platform.machine()};{name};flags={flags}"


def keep(fingerprint: Fingerprint | None, engine: str, root: Path | None = None) -> StartState | None:
    """Give this process's engine the state directory of ``fingerprint``'s identity (made, or emptied where its record
    differs); None where there is no identity, it is turned off, or the user set every setting. Call it before the
    engine compiles (in its loader)."""
    if fingerprint is None or os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    free = [name for name in SETTINGS[engine] if not _user_set(name)]
    if not free:
        return None
    key = state_key(fingerprint, engine)
    try:
        path = (root or state_root()) / hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
        reused = _claim(path, key)
    except OSError as exc:
        log.warning("weightcache: no start state kept for this engine (%s): it computes its own as usual", exc)
        return None
    settings = {name: str(path / name.lower()) for name in free}
    os.environ.update(settings)
    _given.update(settings)
    log.info("weightcache: engine start state in %s (%s)", path, "reused" if reused else "new")
    return StartState(path, reused, settings)


def _claim(path: Path, key: dict[str, str]) -> bool:
    """Whether ``path`` holds state of ``key``; if not, it is emptied and records ``key``."""
    record = path / RECORD
    try:
        if json.loads(record.read_text()) == key:
            return True
    except (OSError, ValueError):
        pass
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    temporary = path / f".{RECORD}.{os.getpid()}"
    temporary.write_text(json.dumps(key, sort_keys=True, indent=1))
    os.replace(temporary, record)
    return False


def _user_set(name: str) -> bool:
    """Whether the user chose ``name``: set, not by ``keep``, and not a default an engine or torch filled in."""
    value = os.environ.get(name)
    if not value or _given.get(name) == value:
        return False
    return os.path.abspath(value) not in {os.path.abspath(default) for default in _defaults(name)}


def _defaults(name: str) -> list[str]:
    """What ``name`` holds when nobody chose it: torch's inductor default (inductor sets it on first use), and SGLang's
    own directories (``import sglang`` sets both settings under ``SGLANG_CACHE_DIR`` unless they are set; a
    ``SGLANG_CACHE_DIR`` the user set is a choice, so its directories are not defaults)."""
    defaults = []
    if name == "TORCHINDUCTOR_CACHE_DIR":
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        defaults.append(default_cache_dir())
    if "sglang" in sys.modules and "SGLANG_CACHE_DIR" not in os.environ:  # importing it here would set them
        try:
            from sglang.srt.environ import third_party_cache_defaults
        except ImportError:  # an SGLang without this redirect
            pass
        else:
            defaults.append(third_party_cache_defaults().get(name, ""))
    return [default for default in defaults if default]
