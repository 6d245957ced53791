"""User-facing errors: bad input gets a short message and exit code 2, never a traceback."""


class UserError(Exception):
    """Bad input from the user (file, column, TOML key, flag, model dir).

    The message names the file/line/key and says what to do. The CLI prints it and exits 2.
    """

    exit_code = 2
