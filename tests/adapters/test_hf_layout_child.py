"""The layout child's fast start: the layout it learns with the garbage collector off and
scikit-learn and scipy refused is the layout this process learns, record for record, for every architecture the tests build; a
model whose code mentions a refused package is refused, not learned; where the child cannot learn a layout the load
builds the skeleton itself, as before.

Real checkpoints (save_pretrained, random weights), real fresh interpreters (never the test zygote: what they import
first is the subject).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.adapters.test_hf_checkpoints import SMALL
from tests.adapters.test_hf_layout import _foreign_configs
from weightcache.adapters.hf import identity, layout_child, layout_process
from weightcache.adapters.hf.loading import skeleton_and_layout
from weightcache.core.request import LoadRequest

OTHER_KINDS = ("t5", "whisper", "vit", "mamba", "bart")
"""tests/models.py's other modalities and encoder-decoders, beside test_hf_checkpoints.py's SMALL."""

LEARN_ALL = """
import json, sys
from weightcache.adapters.hf import layout_child
layout_child.prepare()
learned = {}
for arguments in json.loads(sys.argv[1]):
    layout = layout_child.learn(arguments)
    learned[arguments["model"]] = None if layout is None else layout.to_json().decode()
refused = {name: repr(sys.modules.get(name, "never asked for")) for name in layout_child.REFUSED}
print(json.dumps({"learned": learned, "refused": refused}))
"""


def _arguments(path, dtype: str | None = None) -> dict:
    """What ``LayoutProcess`` passes its child for a request of ``path``."""
    return {"model": str(path), "dtype": dtype, "quantization": None, "options": []}


def _here(path) -> str | None:
    """The layout this process learns of ``path``'s model, as a load does without a child."""
    request = LoadRequest(model=str(path))
    _, learned = skeleton_and_layout(request, identity.load_dtype(request, identity.read_config(request.model)))
    return None if learned is None else learned.to_json().decode()


def _fresh(code: str, *arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *arguments], capture_output=True, text=True, timeout=300)


def test_the_prepared_child_learns_every_architecture_as_this_process_does(model_dir, tmp_path):
    import transformers

    paths = [model_dir(kind, stored) for kind in SMALL for stored in ("float32", "bfloat16")]
    paths += [model_dir(kind) for kind in OTHER_KINDS]
    for kind, config in _foreign_configs().items():  # shared modules, tied embeddings, a speech model
        getattr(transformers, config.architectures[0])(config).eval().save_pretrained(tmp_path / kind)
        paths.append(tmp_path / kind)
    done = _fresh(LEARN_ALL, json.dumps([_arguments(path) for path in paths]))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["refused"] == {"sklearn": "None", "scipy": "None"}, "asked for, refused, never imported"
    for path in paths:
        assert report["learned"][str(path)] == _here(path), f"{path.name}: the child's layout differs from this process's"
    assert None not in report["learned"].values(), "every one has a layout to compare"


@pytest.mark.parametrize("kind", ["gpt2", "qwen2"])
def test_the_child_process_prints_the_layout_this_process_learns(model_dir, kind):
    """The child as the load starts it: its own ``prepare``, its layout flushed before ``os._exit`` (stdout buffered,
    as it is unless the environment says otherwise)."""
    path = model_dir(kind, "bfloat16")
    env = {name: value for name, value in os.environ.items() if name != "PYTHONUNBUFFERED"}
    done = subprocess.run(
        [sys.executable, "-m", layout_process.CHILD, json.dumps(_arguments(path))], capture_output=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert done.stdout.decode() == _here(path)


def test_a_model_whose_code_mentions_a_refused_package_is_refused_not_learned(tmp_path):
    """FNet computes DFT buffers with scipy where it is installed: with scipy refused, its layout could differ."""
    import transformers

    config = transformers.FNetConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1, architectures=["FNetModel"]
    )
    transformers.FNetModel(config).eval().save_pretrained(tmp_path / "fnet")
    done = subprocess.run(
        [sys.executable, "-m", layout_process.CHILD, json.dumps(_arguments(tmp_path / "fnet"))],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == layout_child.EXIT_REFUSED, done.stderr[-3000:]
    assert not done.stdout, "no layout printed"
    assert done.stderr.startswith("transformers.models.fnet.modeling_fnet mentions scipy:"), done.stderr[-3000:]
    assert _here(tmp_path / "fnet") is not None, "this process learns it (the load builds the skeleton itself)"


def _unknown_type(directory):
    (directory / "config.json").write_text(json.dumps({"model_type": "no-such-model", "architectures": ["NoSuchModel"]}))


def _remote_code(directory):
    (directory / "configuration_custom.py").write_text("raise SystemExit('remote code ran')\n")
    config = {"model_type": "custom", "architectures": ["CustomModel"], "auto_map": {"AutoConfig": "configuration_custom.C"}}
    (directory / "config.json").write_text(json.dumps(config))


def _damaged(directory):
    (directory / "config.json").write_text('{"model_type": "llama", ')


@pytest.mark.parametrize("make", [_unknown_type, _remote_code, _damaged], ids=["unknown-model-type", "remote-code", "damaged"])
def test_where_the_child_learns_no_layout_the_load_builds_the_skeleton_as_before(tmp_path, make):
    """The child ends with an error and gives no layout; the load's own skeleton then raises as it did without one."""
    make(tmp_path)
    request = LoadRequest(model=str(tmp_path))
    child = layout_process.LayoutProcess(request)
    assert child.result(timeout=240) is None
    assert child.process.returncode not in (0, None)
    with pytest.raises((ValueError, KeyError, OSError)):
        _here(tmp_path)
