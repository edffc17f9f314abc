"""Conformance kit (filled in by issue 5)."""
