"""The supported PyTorch floor: refused at import below it, declared the same
in pyproject.toml."""
import os
import pathlib
import re
import subprocess
import sys

import pytest

import reprop
from reprop import _tensors

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("version", ["2.7.1", "2.1.0+cu121", "2.3.1", "1.13.1"])
def test_require_torch_refuses_older(version):
    with pytest.raises(ImportError, match=rf"PyTorch 2\.8 or newer, found {re.escape(version)}"):
        _tensors.require_torch(version)


@pytest.mark.parametrize("version", ["2.8.0", "2.8.0+cu128", "2.10.0a0+git1234abc", "2.13.0+cpu", "3.0.0"])
def test_require_torch_accepts_floor_and_newer(version):
    _tensors.require_torch(version)


def test_import_reprop_on_older_torch_raises_import_error():
    # torch < 2.8 lacks what fad needs under a non-reentrant checkpoint; before
    # the floor, import succeeded there and fad gave wrong gradients silently
    code = "import torch; torch.__version__ = '2.7.1'; import reprop"
    env = dict(os.environ, PYTHONPATH=str(pathlib.Path(reprop.__file__).parent.parent))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode != 0
    assert "ImportError: reprop needs PyTorch 2.8 or newer, found 2.7.1" in run.stderr


def test_pyproject_declares_the_floor():
    declared = re.search(r'"torch>=(\d+)\.(\d+)"', (ROOT / "pyproject.toml").read_text())
    assert declared and tuple(map(int, declared.groups())) == _tensors.MIN_TORCH
