"""User-facing errors: bad input gets a short message and exit code 2, never a traceback."""


class UserError(Exception):
    """Bad input from the user (file, column, TOML key, flag, model dir).

    The message names the file/line/key and says what to do. The CLI prints it and exits 2.
    """

    exit_code = 2

    def __init__(self, message: str = "", option: str | None = None):
        super().__init__(message)
        self.option = option  # the config option (field name) at fault, when one is: pipelines point at its key


class Terminated(BaseException):
    """SIGTERM arrived (align installs the handler while a stage runs): the run stops like on Ctrl-C, its artifact
    is marked failed, and the CLI exits 143."""

    exit_code = 143
