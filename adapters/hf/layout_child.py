"""The layout process's child: builds the skeleton of the model its JSON argument names and prints its layout as JSON.

Started by ``layout_process.LayoutProcess`` (``python -m weightcache.adapters.hf.layout_child ARGUMENTS``); exit status 0
with the layout on stdout, 3 where the model's layout cannot be remembered, anything else on an error (on stderr).
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    """The child: build the skeleton of the model the JSON argument names and print its layout as JSON."""
    from weightcache.adapters.hf import identity, loading
    from weightcache.core.request import LoadRequest

    arguments = json.loads(argv[0])
    request = LoadRequest(
        model=arguments["model"],
        dtype=arguments["dtype"],
        quantization=arguments["quantization"],
        options=tuple(tuple(pair) for pair in arguments["options"]),
    )
    dtype = identity.load_dtype(request, identity.read_config(request.model))
    _, learned = loading.skeleton_and_layout(request, dtype)
    if learned is None:
        print("this model's layout cannot be remembered (Layout.of_model); the load builds its skeleton", file=sys.stderr)
        return 3
    sys.stdout.buffer.write(learned.to_json())
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
