"""The one exception type the CLI turns into a one-line message and a non-zero exit."""


class UserError(Exception):
    """Bad input or an unmet precondition the user can fix; str() is the whole message."""

    exit_code = 2
