"""What went wrong, as the exit code tells a CI job: the user's input, or the machine.

Exit codes of every command: 0 within thresholds, 1 divergence beyond them (or a cell that did
not complete), 2 bad input or usage, 5 the environment failed (disk full, read-only file
system, I/O error), 130 interrupted. 3 and 4 are taken by the workers (a failed cell, a failed
job); they show up in a cell's reason, never as the exit code of a command.
"""

from __future__ import annotations

import errno

EXIT_INPUT = 2
EXIT_ENVIRONMENT = 5
EXIT_INTERRUPTED = 130  # 128 + SIGINT; typer gives a command Ctrl-C stopped the same code

# A path the user named that does not exist, is of the wrong kind, or is not theirs to use:
# fixing the command fixes these. Any other OS error is the machine's (a full disk, a read-only
# mount, a failing device, exhausted memory or file descriptors): the same command may work elsewhere.
_INPUT_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG, errno.ELOOP,
                           errno.EACCES, errno.EPERM, errno.EEXIST, errno.ENOTEMPTY})


class InputError(Exception):
    """Bad input or usage. The CLI prints the message as one line on stderr and exits 2."""


class IncomparableRecords(InputError):
    """Two readable records that cannot be compared (other prompts, probe suite or tokenizer)."""


def os_error_exit_code(exc: OSError) -> int:
    return EXIT_INPUT if exc.errno in _INPUT_ERRNOS else EXIT_ENVIRONMENT
