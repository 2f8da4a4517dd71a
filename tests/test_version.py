"""One version (src/smb2/version.py): the package metadata, ``smb2.__version__``,
``smb2 --version`` and ``smb2-server --version`` say the same, and the
CHANGELOG has a section for it."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

import smb2

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def installed() -> str:
    try:
        return importlib.metadata.version("smb2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("smb2 is not installed here (PYTHONPATH=src): no package metadata to compare")


def test_commands_print_the_package_version(installed: str) -> None:
    assert smb2.__version__ == installed
    scripts = Path(sys.executable).parent
    for cmd in ("smb2", "smb2-server"):
        out = subprocess.run([str(scripts / cmd), "--version"], capture_output=True, text=True, timeout=60,
                             check=True).stdout
        assert out.split()[:2] == [cmd, installed], out


def test_changelog_has_this_version() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## \[{re.escape(smb2.__version__)}\] - \d{{4}}-\d{{2}}-\d{{2}}$", text, re.M), \
        f"CHANGELOG.md has no section '## [{smb2.__version__}] - YYYY-MM-DD'"
    assert "## [Unreleased]" in text
