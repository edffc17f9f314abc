"""A model's tensors into arenas and back: export, checkpoint files read straight into arenas, the one publish
sequence, rebinding a meta model; the checks and the read-ahead that come before a load reads."""
