"""The one exception type that means "the user gave us something wrong"."""


class InputError(Exception):
    """Bad input or usage. The CLI prints the message as one line on stderr and exits 2."""
