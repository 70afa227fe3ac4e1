"""reprop: faster, leaner PyTorch training by restructuring backprop.

Importing reprop needs no GPU, driver or CUDA toolkit; CUDA code paths are
chosen at run time by the tensors' device.
"""
from ._native import cuda_available, cuda_built, cuda_error
from . import bppsa, fad, fusion, ooo, optim
from .fusion import fuse
from ._tensors import ReproPWarning

__version__ = "0.1.0"

__all__ = ["__version__", "ReproPWarning", "bppsa", "cuda_available", "cuda_built", "cuda_error", "fad",
           "fuse", "fusion", "ooo", "optim"]
