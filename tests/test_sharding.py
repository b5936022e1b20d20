"""Sharded bundles: the cases run in a process of their own with 8 fake CPU devices (tests/sharded_cases.py)."""

import os
import subprocess
import sys
from pathlib import Path


def test_sharded_cases_on_8_fake_devices():
    root = Path(__file__).parent.parent
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    run = subprocess.run([sys.executable, "-m", "tests.sharded_cases"], cwd=root, env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-8000:]
    assert "all sharded cases passed" in run.stdout
