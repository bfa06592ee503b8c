"""Ray is an optional extra: plain ``pie serve`` (one engine) never imports it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.e2e  # starts a Python process


def test_plain_serve_does_not_import_ray():
    code = (
        "import sys; from pie_runtime.cli.main import build_parser; "
        "import pie_runtime.cli.serve, pie_runtime.serve.app, pie_runtime.serve.backend; build_parser(); "
        "assert 'ray' not in sys.modules, 'ray imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
