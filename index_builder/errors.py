"""The one error of `index_builder`'s commands: the CLI exits 2 with its message."""


class BuildError(Exception):
    """Bad input or a conflicting earlier build; the CLI exits 2 with this message."""
