"""Moved to :mod:`inferlet.text.tool_calls`: this old path re-exports it and warns (it goes in the next release)."""

from .moved import warn_moved
from .text.tool_calls import *  # noqa: F403

warn_moved("inferlet.tool_calls")
