"""The one error type for bad input and bad configuration.

Every message names what is wrong - the file, the column, the option - and the rule it broke,
so a job can end with that one line (exit 2) instead of a traceback.
"""


class InputError(ValueError):
    """Bad input data or a bad option; the message names the file or option and the rule."""
