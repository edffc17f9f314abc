"""Built-in adapters, one subpackage per engine; each registers through the ``weightcache.adapters`` entry points."""
