"""Stand-ins for a process group's pieces in the in-process shard and client tests."""


class Done:
    """A posted operation: `wait` does what the message does (once)."""

    def __init__(self, then=None):
        self.then = then

    def wait(self):
        if self.then is not None:
            self.then()
            self.then = None
