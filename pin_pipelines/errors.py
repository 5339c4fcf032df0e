"""The one exception type that the CLI turns into a one-line message instead of a traceback."""


class PinError(Exception):
    """An expected failure a person can act on: unreachable service, bad argument, busy resource."""
