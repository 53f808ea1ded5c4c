"""The one exception every stage turns into a one-line message and exit code 2 (distill.cli.cli)."""


class ConfigError(ValueError):
    """A user-facing configuration error; the message says what to change."""
