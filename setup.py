"""Build of reprop's native extensions.

reprop._C     csrc/ in C11 with OpenMP and NumPy's C API; always built.
reprop._cuda  kernels/*.cu compiled by nvcc (sm_80, sm_90, PTX) and linked with
              the static CUDA runtime, so importing it needs no driver. Built
              when nvcc is found, unless REPROP_CUDA=0; REPROP_CUDA=1 makes a
              missing nvcc an error.

Nothing links libtorch: torch is used from Python only, so one build serves
every PyTorch >= 2.1.
"""
import os
import shutil
import subprocess

import numpy
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

CUDA_ARCHS = ("80", "90")
CORE_SOURCES = ["csrc/common.c", "csrc/fad.c", "csrc/jacobian.c", "csrc/optim.c", "csrc/pyutil.c",
                "csrc/scan.c", "csrc/schedule.c"]
# -ffp-contract=off: no fused multiply-adds the source does not ask for, so the
# CPU math rounds term by term like torch's; -fno-math-errno lets sqrtf vectorise.
C_FLAGS = ["-std=c11", "-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off",
           "-Wall", "-Wextra", "-Wno-unused-parameter"]


def cuda_home():
    """The CUDA toolkit to build with, or None when it should be skipped."""
    want = os.environ.get("REPROP_CUDA", "")
    if want == "0":
        return None
    nvcc = shutil.which("nvcc")
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    if nvcc is not None:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates.append("/usr/local/cuda")  # nvcc on PATH may be a wrapper script
    for home in filter(None, candidates):
        if os.path.exists(os.path.join(home, "bin", "nvcc")) and cuda_lib_dir(home):
            return home
    if want == "1":
        raise RuntimeError("REPROP_CUDA=1 but no CUDA toolkit (nvcc and libcudart_static.a) "
                           "was found via CUDA_HOME, PATH or /usr/local/cuda")
    return None


def cuda_lib_dir(home):
    """The folder of home's static CUDA runtime, or None."""
    for sub in ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib")):
        if os.path.exists(os.path.join(home, sub, "libcudart_static.a")):
            return os.path.join(home, sub)
    return None


class BuildExt(build_ext):
    """Compiles the .cu sources of an extension with nvcc before linking."""

    def build_extension(self, ext):
        cu_sources = [s for s in ext.sources if s.endswith(".cu")]
        if cu_sources:
            ext.sources = [s for s in ext.sources if not s.endswith(".cu")]
            ext.extra_objects = self.compile_cuda(ext, cu_sources)
        super().build_extension(ext)

    def compile_cuda(self, ext, sources):
        nvcc = os.path.join(ext.cuda_home, "bin", "nvcc")
        gencode = []
        for arch in CUDA_ARCHS:
            gencode += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
        last = CUDA_ARCHS[-1]
        gencode += ["-gencode", f"arch=compute_{last},code=compute_{last}"]
        archs = " ".join(f"sm_{a}" for a in CUDA_ARCHS) + f" compute_{last}"
        objects = []
        for src in sources:
            obj = os.path.join(self.build_temp, os.path.splitext(src)[0] + ".o")
            os.makedirs(os.path.dirname(obj), exist_ok=True)
            # --fmad=false: the same rounding as the CPU build (-ffp-contract=off),
            # so CUDA and CPU updates agree bit for bit; the kernels are memory-bound.
            cmd = [nvcc, "-std=c++17", "-O3", "--fmad=false", "-Xcompiler", "-fPIC", "-Icsrc",
                   f'-DRP_CUDA_ARCHS="{archs}"', *gencode, "-c", src, "-o", obj]
            print(" ".join(cmd))
            subprocess.check_call(cmd)
            objects.append(obj)
        return objects


def extensions():
    include = ["csrc", numpy.get_include()]
    exts = [Extension("reprop._C", ["csrc/module.c", *CORE_SOURCES], include_dirs=include,
                      extra_compile_args=C_FLAGS, extra_link_args=["-fopenmp"])]
    home = cuda_home()
    if home is not None:
        cuda = Extension("reprop._cuda", ["csrc/module_cuda.c", *CORE_SOURCES, "kernels/optim.cu",
                                          "kernels/fad.cu", "kernels/scan.cu"],
                         include_dirs=include, extra_compile_args=C_FLAGS,
                         library_dirs=[cuda_lib_dir(home)],
                         libraries=["cudart_static", "stdc++", "rt", "pthread", "dl"],
                         extra_link_args=["-fopenmp"])
        cuda.cuda_home = home
        exts.append(cuda)
    return exts


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildExt})
