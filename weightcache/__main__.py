"""``python -m weightcache …``: the ``weightcache`` command, for an environment whose scripts are not on PATH."""

from weightcache.core.cli.cli import entry

if __name__ == "__main__":
    entry()
