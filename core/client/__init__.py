"""The engine's side of the socket: requests, an attached entry and its mapped arenas, re-publishing to a new server."""
