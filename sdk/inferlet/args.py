"""Moved to :mod:`inferlet.text.arguments`: this old path re-exports it and warns (it goes in the next release)."""

from .moved import warn_moved
from .text.arguments import *  # noqa: F403

warn_moved("inferlet.args")
