"""The ``weightcache`` command line: its subcommands, the options they share, one line per mistake, the demo."""
