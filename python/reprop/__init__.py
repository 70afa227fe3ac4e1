"""reprop: faster, leaner PyTorch training by restructuring backprop.

Importing reprop needs no GPU, driver or CUDA toolkit; CUDA code paths are
chosen at run time by the tensors' device.
"""
# cuda_archs too: README tells users to call reprop.cuda_archs() (it was only in
# reprop._native, so that call raised AttributeError)
from ._native import cuda_archs, cuda_available, cuda_built, cuda_error
from . import bppsa, fad, fusion, ooo, optim
from .fusion import fuse
from ._tensors import ReproPWarning

__version__ = "0.1.0"

__all__ = ["__version__", "ReproPWarning", "bppsa", "cuda_archs", "cuda_available", "cuda_built", "cuda_error", "fad",
           "fuse", "fusion", "ooo", "optim"]
