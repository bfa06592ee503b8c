"""Moved to :mod:`inferlet.spec.token_tree`: this old path re-exports it and warns (it goes in the next release)."""

from .moved import warn_moved
from .spec.token_tree import *  # noqa: F403

warn_moved("inferlet.tree")
