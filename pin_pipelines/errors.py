"""The one exception type that the CLI turns into a one-line message instead of a traceback."""


class PinError(Exception):
    """An expected failure a person can act on: unreachable service, bad argument, busy resource."""


def first_line(exc: BaseException) -> str:
    """An exception's message on one line (a driver's may run over many: a server's context, a
    stack trace); its type's name when it has none."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
