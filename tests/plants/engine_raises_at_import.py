"""An engine module that raises at import (a user's engine with a bug at module level): bad input, exit 2."""

raise RuntimeError("planted: this engine module cannot be imported")


def make(case, ctx):  # never reached
    raise AssertionError
