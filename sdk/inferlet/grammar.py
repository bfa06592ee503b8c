"""Moved to :mod:`inferlet.text.grammar`: this old path re-exports it and warns (it goes in the next release)."""

from .moved import warn_moved
from .text.grammar import *  # noqa: F403

warn_moved("inferlet.grammar")
