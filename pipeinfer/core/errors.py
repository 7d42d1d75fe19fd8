"""The error a user's mistake raises: reported as one line and a non-zero exit on every rank."""


class UserError(Exception):
    """Bad input: reported as one line, non-zero exit on every rank."""
