"""The test suite. ``tests.drafter_fixtures`` is a pytest plugin that conftest modules also import, so its
asserts are registered for rewriting before the first import."""

import pytest

pytest.register_assert_rewrite("tests.drafter_fixtures")
