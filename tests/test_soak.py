"""The soak (tools/soak.py) in its timed mode: server processes, client
processes, random writes/reads/accumulates/fetch-adds (and locked updates
when the lock exists), every byte verified.  ``SMB2_SOAK_SECONDS`` sets the
duration (default 60: the issue's 60-second mode)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import smb2

ROOT = Path(__file__).resolve().parent.parent
SECONDS = float(os.environ.get("SMB2_SOAK_SECONDS", "60"))


@pytest.mark.slow
@pytest.mark.timeout(SECONDS + 180)
def test_soak(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "soak.py"), "--seconds", str(SECONDS),
                           "--json", str(out)], capture_output=True, text=True, timeout=SECONDS + 170)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(out.read_text())
    assert r["errors"] == 0
    for kind in ("write", "read", "accumulate", "fetch_add"):
        assert r["ops"].get(kind, 0) > 0, r["ops"]
    assert r["bytes_verified"] > 0
    if hasattr(smb2.Client, "lock"):
        assert r["ops"].get("locked_update", 0) > 0, r["ops"]
    for start, end in zip(r["server_rss_start"], r["server_rss_end"]):
        assert end - start < 16 << 20, f"a server's RSS grew from {start} to {end} during the soak"
