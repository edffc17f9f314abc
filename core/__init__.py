"""weightcache core: fingerprints, arenas, the wire protocol, server, client and CLI.

Importing this package loads nothing heavy; torch is imported by the modules that need it.
"""

__version__ = "0.1.0"
PROTOCOL_VERSION = 2
