"""weightcache across nodes: seed an entry to another node's server, or receive one (``weightcache seed`` and
``weightcache fleet`` are the command-line forms; docs/operations.md).
"""

# an entry sent to, or received from, a peer node
from weightcache.core.node.seeding import send_entry as send_entry, receive_entry as receive_entry

# errors
from weightcache.core.errors import SeedRefused as SeedRefused, SeedFailed as SeedFailed
from weightcache.core.errors import FleetUnavailable as FleetUnavailable, PullFailed as PullFailed
