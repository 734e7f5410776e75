"""One exception type for input a user can fix; the CLI prints its message as one line and exits 2."""


class BadInputError(ValueError):
    """Input a user can fix. The message names the input, where it is (file/row, config key) and the fix."""
