"""Moved to :mod:`inferlet.spec.ngram_lookup`: this old path re-exports it and warns (it goes in the next release)."""

from .moved import warn_moved
from .spec.ngram_lookup import *  # noqa: F403

warn_moved("inferlet.lookup")
