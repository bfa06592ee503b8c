"""Moved to :mod:`inferlet.text.choices`: this old path re-exports it and warns (it goes in the next release)."""

from .moved import warn_moved
from .text.choices import *  # noqa: F403

warn_moved("inferlet.choices")
