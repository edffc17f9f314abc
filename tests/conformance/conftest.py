"""The adapter guide's example package (examples/tinylm-adapter), importable, and a TinyLM checkpoint."""

from __future__ import annotations

import sys

import pytest

from tests.helpers import EXAMPLE_SRC


@pytest.fixture(scope="module")
def example_package():
    """The example package, importable for this module only."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(EXAMPLE_SRC))
        import weightcache_example
        import weightcache_example.plugin

        try:
            yield weightcache_example
        finally:
            for name in [n for n in sys.modules if n.partition(".")[0] == "weightcache_example"]:
                del sys.modules[name]


@pytest.fixture(scope="module")
def example_checkpoint(example_package, tmp_path_factory):
    """A random-weight TinyLM checkpoint."""
    return example_package.save_checkpoint(tmp_path_factory.mktemp("tinylm"))
