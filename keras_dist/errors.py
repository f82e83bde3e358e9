"""Exception and warning types that users may need to catch.

keras-dist raises built-in types (`ValueError`, `TypeError`, `RuntimeError`) for
bad input and wrong state; the types here exist only where a user needs to tell
keras-dist's own conditions apart from everything else.
"""


class KerasDistWarning(UserWarning):
    """Base class of every warning keras-dist emits (so tests can turn them into errors)."""
