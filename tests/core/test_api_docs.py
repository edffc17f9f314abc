"""docs/api.md's Python snippets run as they are, on BERT, Llama and T5 checkpoints, against a real server.

The snippets are taken from the file (every ```python block, in order), the placeholder
checkpoint path is replaced by a fixture's, and the result runs in a fresh interpreter.
After them, a check attaches the published entry again, rebinds a second meta model and
compares its outputs with the loader's model bit for bit.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from tests import zygote

API_DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
PLACEHOLDER = "/models/llama"

CHECK_OUTPUTS = """
# --- the test's own check, after the snippets ---
from tests.helpers import assert_tensors_equal

with torch.device("meta"):
    again = model_class(config)
second = weightcache.engine.attach(fp)
weightcache.engine.rebind(again, second, device=device)
ids = torch.arange(24).reshape(2, 12) % config.vocab_size
inputs = {"input_ids": ids}
if config.is_encoder_decoder:
    inputs["decoder_input_ids"] = ids[:, :5]
with torch.no_grad():
    expected, actual = model(**inputs)[0], again(**inputs)[0]
assert_tensors_equal("first output", actual, expected)
second.close()
print("outputs bit-identical")
"""


def python_blocks(markdown: str) -> list[str]:
    """The code of every ```python block, in order."""
    return re.findall(r"^```python\n(.*?)^```", markdown, flags=re.MULTILINE | re.DOTALL)


def test_the_doc_has_both_snippets_and_the_placeholder():
    blocks = python_blocks(API_DOC.read_text())
    assert len(blocks) == 2 and all(PLACEHOLDER in block for block in blocks), "docs/api.md changed shape: update this test"


@pytest.mark.parametrize("kind", ["bert", "llama", "t5"])
def test_api_md_snippets_run_verbatim(kind, model_dir, server):
    script = "\n".join(python_blocks(API_DOC.read_text())).replace(PLACEHOLDER, str(model_dir(kind)))
    proc = zygote.run(
        [sys.executable, "-c", script + CHECK_OUTPUTS],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "WEIGHTCACHE_SOCKET_DIR": str(server.socket_dir)},
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 0, f"docs/api.md's snippets failed on {kind}:\n{proc.stderr[-4000:]}"
    assert proc.stdout.strip().endswith("outputs bit-identical"), proc.stdout
