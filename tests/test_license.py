"""The LICENSE file is the license pyproject.toml declares."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# MD5 of https://www.apache.org/licenses/LICENSE-2.0.txt, the text every Apache-2.0 project ships.
_APACHE_2_MD5 = "3b83ef96387f14655fc854ddc3c6bd57"


def test_license_file_is_the_declared_apache_2_text() -> None:
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"]
    assert declared == {"text": "Apache-2.0"}
    text = (ROOT / "LICENSE").read_bytes()
    assert b"Apache License" in text[:200] and b"Version 2.0, January 2004" in text[:200]
    assert hashlib.md5(text).hexdigest() == _APACHE_2_MD5  # the full, unmodified text
