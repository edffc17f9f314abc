"""An engine in its own process, driven over stdin/stdout by tests.

Commands (one per line): ``hash`` prints the output digest, ``maps`` the
inodes of mapped arenas, ``opens`` the safetensors files opened (with
``--count-opens``), ``write`` adds 1 to a weight in place, ``quit``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys


def output_digest(model) -> str:
    import torch

    vocab = getattr(model.config, "vocab_size", 512)
    input_ids = (torch.arange(32, dtype=torch.long).reshape(2, 16) * 31 % vocab).to(next(model.parameters()).device)
    with torch.no_grad():
        output = model(input_ids=input_ids)
    tensor = output[0] if isinstance(output, (tuple, list)) else next(iter(output.values()))
    return hashlib.sha256(tensor.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()


def arena_inodes() -> list[int]:
    """Inodes of the weightcache memfds this process maps (from /proc/self/maps)."""
    inodes = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "weightcache-arena" in line:
                inodes.add(int(line.split()[4]))
    return sorted(inodes)


def watch_opens(model: str):
    """A function that lists the files in ``model``'s directory opened since now, by any code (inotify).

    Python's audit hook misses files that native code opens (safetensors reads
    through Rust); the kernel's IN_OPEN events do not.
    """
    import ctypes
    import struct

    directory = model if os.path.isdir(model) else os.path.dirname(model)
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    if fd < 0 or libc.inotify_add_watch(fd, os.fsencode(directory), 0x20) < 0:  # IN_OPEN
        raise OSError(ctypes.get_errno(), f"cannot watch {directory} with inotify")

    def opened() -> list[str]:
        names = []
        while True:
            try:
                data = os.read(fd, 1 << 16)
            except BlockingIOError:
                return names
            offset = 0
            while offset < len(data):
                _, _, _, length = struct.unpack_from("iIII", data, offset)
                name = data[offset + 16 : offset + 16 + length].rstrip(b"\0").decode()
                names.append(os.path.join(directory, name))
                offset += 16 + length

    return opened


def _gpu_free(device: str):
    """Free GPU memory after this process's CUDA context exists (None on CPU)."""
    if not device.startswith("cuda"):
        return None
    import torch

    torch.zeros(1, device=device)
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--socket-dir", required=True)
    parser.add_argument("--mode", default="client")
    parser.add_argument("--dtype")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--count-opens", action="store_true", help="count opens of *.safetensors files (audit hook and inotify)")
    args = parser.parse_args()
    opens = []
    watched = list
    if args.count_opens:
        sys.addaudithook(
            lambda event, hook_args: (
                opens.append(hook_args[0]) if event == "open" and str(hook_args[0]).endswith(".safetensors") else None
            )
        )
        watched = watch_opens(args.model)
    from weightcache.core.flow.modes import load_model

    free_before = _gpu_free(args.device)
    loaded = load_model(args.model, mode=args.mode, socket_dir=args.socket_dir, dtype=args.dtype, device=args.device, strict=True)
    ready = {
        "ready": True,
        "pid": os.getpid(),
        "source": loaded.source,
        "digest": loaded.fingerprint.digest if loaded.fingerprint else None,
    }
    if free_before is not None:
        ready["gpu_bytes_taken"] = free_before - _gpu_free(args.device)
    print(json.dumps(ready), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "hash":
            print(json.dumps({"hash": output_digest(loaded.model)}), flush=True)
        elif command == "maps":
            print(json.dumps({"inodes": arena_inodes()}), flush=True)
        elif command == "write":
            import torch

            with torch.no_grad():
                next(loaded.model.parameters()).add_(1)
            print(json.dumps({"wrote": True}), flush=True)
        elif command == "opens":
            native = [p for p in watched() if p.endswith(".safetensors")]
            print(json.dumps({"opens": [str(p) for p in opens], "kernel_opens": native}), flush=True)
        elif command == "quit":
            break
    loaded.close()


if __name__ == "__main__":
    main()
