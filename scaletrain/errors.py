"""Errors a user can act on, and the exit status of each. The CLI prints them as plain messages, never as
tracebacks; the launcher's diagnosis reads the statuses back (scaletrain.resilience.diagnose). Also why a path
cannot be written, in words (`unwritable`), for the messages of those errors."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

USER_ERROR_EXIT_CODE = 1
"""A UserError: bad input or environment, printed as one "error: ..." line."""
CONFIG_EXIT_CODE = 2
"""A ConfigError or a command line argparse refuses: no restart can cure it."""
INTERRUPTED_EXIT_CODE = 130
"""Ctrl-C (128 + SIGINT), as a shell reports it."""
STOPPED_EXIT_CODE = 75
"""Stopped early by run.time_limit or run.stop_at_step with a committed checkpoint: run the same command again to
continue (a requeue script's cue). 75 is sysexits.h's EX_TEMPFAIL, "try again later"."""


class UserError(Exception):
    """A problem with the user's input or environment: the message says what to change."""


class ConfigError(UserError):
    """One or more configuration problems, reported together."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__(self.render())

    def render(self) -> str:
        lines = [f"{len(self.problems)} problem(s) in the configuration:"]
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)


def report_errors(command: Callable[[], int]) -> int:
    """Run a command and return its exit status; a UserError ends it as one plain "error: ..." message on stderr
    (no traceback) with its status, Ctrl-C with 130."""
    try:
        return command()
    except ConfigError as e:
        print(f"error: {e.render()}", file=sys.stderr)
        return CONFIG_EXIT_CODE
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    except KeyboardInterrupt:
        print("\ninterrupted (Ctrl-C); nothing already written was removed", file=sys.stderr)
        return INTERRUPTED_EXIT_CODE


def unwritable(path: Path, error: OSError) -> str:
    """Why `path` could not be created or written, in words: a parent that is a regular file is named (the OS says
    only "File exists" or "Not a directory")."""
    for parent in [path, *path.parents]:
        if parent.exists():
            if not parent.is_dir() and parent != path:
                return f"{parent} is a file, not a directory"
            break
    return error.strerror or str(error)
