"""Moved to :mod:`inferlet.spec.suffix_index`: this old path re-exports it and warns (it goes in the next release)."""

from .moved import warn_moved
from .spec.suffix_index import *  # noqa: F403

warn_moved("inferlet.suffix")

if __name__ == "__main__":  # `python -m inferlet.suffix build ...`, the old command
    import sys

    from .spec.suffix_index import main

    sys.exit(main())
