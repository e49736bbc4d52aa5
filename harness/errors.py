"""Errors the CLI turns into exit code 2 with a one-line reason."""


class BadInput(ValueError):
    """User input that cannot run: unknown model, invalid layout, corrupt baseline, missing dependency."""


class MissingDependency(BadInput):
    """An engine or path needs a package that is not installed; the message names the install command."""
