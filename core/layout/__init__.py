"""Where a published model's tensors lie in its arenas: the manifest, its tensor table, the views made from it."""
