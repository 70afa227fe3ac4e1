"""Command line: `python -m reprop info` prints how reprop was built."""
from __future__ import annotations

import argparse
import platform

import torch

from . import __version__
from ._native import _C, cuda_archs, cuda_available, cuda_built, cuda_error


def build_info() -> dict:
    """The facts `python -m reprop info` prints, as a dict."""
    core = _C.build_info()
    return {
        "reprop": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "openmp": core["openmp"],
        "omp_max_threads": core["omp_max_threads"],
        "torch_threads": torch.get_num_threads(),
        "cuda_built": cuda_built(),
        "cuda_error": cuda_error(),  # why a built reprop._cuda did not load
        "cuda_archs": cuda_archs(),
        "cuda_available": cuda_available(),
        "cuda_device": torch.cuda.get_device_name() if cuda_available() and torch.cuda.is_available() else None,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reprop")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="print how reprop was built")
    args = parser.parse_args(argv)
    if args.command == "info":
        for key, value in build_info().items():
            print(f"{key:16s} {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
