"""The project's error type: anything a user can cause, with the fix in the message."""


class DraftlineError(ValueError):
    """A problem with the user's input (a file, a config field, a command-line option).

    The message names what is wrong and how to fix it. It subclasses ``ValueError`` so callers
    that catch ``ValueError`` for bad input keep working.
    """


class MachineError(DraftlineError):
    """A problem of the machine rather than of the input (a full disk): told like a ``DraftlineError``, with
    the fix, but the run counts as failed (exit code 1), not as refused."""
