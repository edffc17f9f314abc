"""What crosses the server's socket: length-prefixed JSON frames with fds, and the trust checks of both sides."""
