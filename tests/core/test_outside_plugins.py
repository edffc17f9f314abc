"""A quantization method and a transport from an outside package: installed (a dist-info with entry points on the
path, as pip leaves one), each is found by name through its entry-point group, and the hf adapter loads, publishes
and attaches a model with the method it has never heard of; without the package, the method is refused."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from weightcache.core.errors import UnsupportedQuantization
from weightcache.core.quantization.allowlist import check_quantization

PACKAGE = '''
"""An outside package's plugins for weightcache: a per-row int8 method and an in-process transport."""

import ctypes
import os

import torch

from weightcache.adapter import QuantizationMethod, UnsupportedQuantization
from weightcache.core.node.fleet.transport import Transport


class RowInt8(QuantizationMethod):
    """Each Linear weight rounded to 255 levels per row (scale: the row's largest magnitude over 127)."""

    name = "toy-int8"
    convertible = "only nn.Linear layers"

    def accept(self, declared, options):
        if declared is not None:
            raise UnsupportedQuantization(self.name, "no checkpoint is stored in toy-int8")
        return {"method": self.name, "levels": 255}

    def quantize(self, model, config):
        converted = []
        with torch.no_grad():
            for name, module in model.named_modules():
                if type(module) is torch.nn.Linear:
                    weight = module.weight
                    scale = weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
                    weight.copy_((weight / scale).round().clamp(-127, 127) * scale)
                    converted.append(name)
        return converted


class Loopback(Transport):
    """Reads another region of this very process (the reach names the process)."""

    name = "loopback"

    def __init__(self, agent_name, devices=""):
        self.agent_name = agent_name

    def share(self, regions):
        return f"loopback:{os.getpid()}"

    def unshare(self, regions):
        pass

    def read(self, reach, remote, local, deadline_s):
        assert reach == f"loopback:{os.getpid()}", reach
        for source, target in zip(remote, local):
            ctypes.memmove(target.address, source.address, source.length)
        return "in-process memmove"

    def memory_kinds(self):
        return frozenset({"DRAM"})

    def close(self):
        pass
'''

ENTRY_POINTS = """
[weightcache.quantization]
toy-int8 = toyplugins:RowInt8

[weightcache.transports]
loopback = toyplugins:Loopback
"""

SCRIPT = """
import ctypes, sys

import torch

import weightcache
from weightcache.adapter import check_quantization, quantization_method
from weightcache.core.node.fleet.transport import Region, transport

check_quantization("toy-int8")
assert type(quantization_method("toy-int8")).__name__ == "RowInt8"

first = weightcache.load_model(sys.argv[1], mode="daemon", quantization="toy-int8")
assert first.fingerprint.quantization == "toy-int8", first.fingerprint
assert first.fingerprint.quantization_config == '{"levels":255,"method":"toy-int8"}', first.fingerprint
linears = [m for m in first.model.modules() if type(m) is torch.nn.Linear]
assert linears and all(len(row.unique()) <= 255 for m in linears for row in m.weight), "not quantized"
again = weightcache.load_model(sys.argv[1], mode="client", quantization="toy-int8", strict=True)
assert again.source == "cache", again.source
for (name, a), (_, b) in zip(first.model.state_dict().items(), again.model.state_dict().items()):
    assert torch.equal(a, b), name

source, target = (ctypes.c_char * 64)(*b"weights" * 9, *b"!"), (ctypes.c_char * 64)()
link = transport("loopback", "agent")
how = link.read(link.share([]), [Region(ctypes.addressof(source), 64)], [Region(ctypes.addressof(target), 64)], 5.0)
assert bytes(target) == bytes(source) and how == "in-process memmove"
print("outside plugins work")
"""


@pytest.fixture
def installed(tmp_path):
    """The outside package as pip installs it: its module and a dist-info with its entry points."""
    site = tmp_path / "site"
    (site / "toyplugins").mkdir(parents=True)
    (site / "toyplugins" / "__init__.py").write_text(textwrap.dedent(PACKAGE))
    info = site / "toyplugins-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toyplugins\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    return site


def test_a_method_and_a_transport_from_an_outside_package_are_found_and_used(installed, model_dir, server):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(installed), os.environ.get("PYTHONPATH", "")]),
        "WEIGHTCACHE_SOCKET_DIR": str(server.socket_dir),
    }
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(model_dir("llama"))], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.strip().endswith("outside plugins work"), proc.stdout


def test_without_the_package_the_method_is_refused_as_unknown():
    with pytest.raises(UnsupportedQuantization, match="it is unknown to weightcache"):
        check_quantization("toy-int8")
