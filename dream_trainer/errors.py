"""Exceptions with a meaning for the loop, importable from anywhere without import cycles."""


class StopTraining(Exception):
    """Raise from a hook to end ``fit()`` cleanly at that point (every rank must raise it).

    ``fit()`` fires ``post_fit``, tears the process group down and returns normally.
    """
