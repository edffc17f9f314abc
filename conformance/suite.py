"""The kit on the model the command-line options name (``--weightcache-adapter``, ``--weightcache-model``).

``pytest -p weightcache.conformance --weightcache-adapter NAME --weightcache-model PATH`` runs this module
(``weightcache conformance`` too); in your own suite, subclass the classes instead.
"""

from __future__ import annotations

from weightcache.conformance.checks import ConformanceTests
from weightcache.conformance.fixtures import ConformanceFixtures


class TestAdapterConformance(ConformanceFixtures, ConformanceTests):
    """Every check, configured from the command-line options."""
