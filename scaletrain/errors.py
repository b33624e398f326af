"""Errors a user can act on. The CLI prints them as plain messages, never as tracebacks."""

from __future__ import annotations


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
