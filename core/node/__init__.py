"""The node as one cache: a GPU's entry filled from a peer GPU or the host tier, an entry seeded from a peer node."""
