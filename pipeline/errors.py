"""User-facing errors: the CLI prints these as one clear message, without a traceback."""


class UserError(Exception):
    """Something the user can fix (bad option, bad input, changed files); printed without a traceback."""


class MergeError(UserError):
    """Shards do not add up to the index (missing, duplicate, extra or mismatched rows)."""


class RunDirError(UserError):
    """The output directory is missing, belongs to another run, or is in use."""
