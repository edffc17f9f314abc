"""``python -m weightcache.core.cli``, 0.1.0's way to run the command: it still runs it, warning (``python -m weightcache``)."""

from weightcache.core.cli.cli import entry
from weightcache.core.old_paths import DEPRECATED_SINCE, REMOVED_IN

if __name__ == "__main__":
    import warnings

    warnings.warn(
        f"python -m weightcache.core.cli is deprecated since weightcache {DEPRECATED_SINCE} and goes in {REMOVED_IN}: "
        "use python -m weightcache (or the weightcache command)",
        DeprecationWarning,
        stacklevel=1,
    )
    entry()
