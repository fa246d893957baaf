"""The one exception type that means "the user's input is wrong", not "the code is wrong"."""


class UserError(Exception):
    """Bad input: a one-line message that says what was wrong and how to fix it.

    ``train.py`` prints it as ``error: <message>`` and exits with status 2, without a traceback.
    Every component may raise it; nothing else should be caught and rephrased as one.
    """


class DataError(UserError):
    """Damaged training data beyond what the run may skip (``--max-bad-records``).

    Raised where the data is read (a loader worker); ``main`` keeps its message in the output
    folder so that a torchrun restart refuses at once instead of training into it again.
    """


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (its type's name when it has none), for a UserError
    that names a library's reason in one line."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
