"""The error every stage raises for bad input or configuration."""


class UsageError(Exception):
    """Bad input or configuration: one clear line, exit code 1."""
