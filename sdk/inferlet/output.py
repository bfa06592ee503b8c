"""Moved to :mod:`inferlet.text.output`: this old path re-exports it and warns (it goes in the next release)."""

from .moved import warn_moved
from .text.output import *  # noqa: F403

warn_moved("inferlet.output")
