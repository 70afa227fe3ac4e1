"""A Python script run in a fresh interpreter, for the test modules (not a
test module): what a test cannot undo in its own process, such as
importlib.reload of reprop's modules.

    script_output(script, *args) -> list[str]
        The words `script` printed, run as `python -c script *args` with
        this checkout's reprop first on its path; asserts it exited 0
        (showing its stderr otherwise).
"""

from __future__ import annotations

import os
import subprocess
import sys

import reprop


def script_output(script: str, *args: str) -> list[str]:
    root = os.path.dirname(os.path.dirname(reprop.__file__))
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": root})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()
