"""What an inferlet raises when its user must change something before it can run: a missing drafter, an
argument the model cannot serve. ``pie run`` prints it as one line (no traceback) and ``pie serve`` answers it
as a 400 ``invalid_request_error``; any other exception is a bug and keeps its traceback."""

from __future__ import annotations


class UsageError(Exception):
    """A one-line message saying what is missing and the command that provides it."""


class ArgumentError(UsageError, ValueError):
    """An argument the inferlet does not take, lacks or cannot read (the words after ``--``, or a host's run
    request): one line naming it, and for an unknown name the inferlet's own name closest to it."""


class EngineUnreachable(UsageError):
    """No engine answered ``hello`` at the address in time: none listens there, or (on ``tcp://``) the token is
    wrong. The message names the address and the command that starts an engine there."""
