"""Build of reprop's native extensions.

reprop._C     csrc/ in C11 with OpenMP and NumPy's C API; always built.
reprop._cuda  kernels/*.cu compiled by nvcc (sm_80, sm_90, PTX) and linked with
              the static CUDA runtime, so importing it needs no driver. Built
              when nvcc is found, unless REPROP_CUDA=0; REPROP_CUDA=1 makes a
              missing nvcc an error.

              With cuSPARSE's header (cusparse.h) found, it also holds the
              cuSPARSE peer of the sparse BPPSA scan (RP_HAVE_CUSPARSE),
              which loads libcusparse.so.12 at run time and never links it;
              the header is looked for in REPROP_CUSPARSE_INCLUDE (then
              required), the toolkit's include, and the nvidia-cusparse
              wheel's (nvidia/cu13, nvidia/cu12, nvidia/cusparse).

Nothing links libtorch: torch is used from Python only, so one build serves
every PyTorch >= 2.8 (the oldest `import reprop` accepts).
"""
import importlib.util
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


def nvidia_wheel_dirs(sub):
    """`sub` (include, lib) of each layout of NVIDIA's pip wheels that exists:
    nvidia/cu13 and nvidia/cu12 (CUDA 13 era), nvidia/cusparse (CUDA 12)."""
    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    return [os.path.join(root, layout, sub) for root in roots for layout in ("cu13", "cu12", "cusparse")
            if os.path.isdir(os.path.join(root, layout, sub))]


def cusparse_include(home):
    """The folder holding cusparse.h for the cuSPARSE peer, or None (the peer
    is left out, the build goes on: a machine without the wheel still builds)."""
    given = os.environ.get("REPROP_CUSPARSE_INCLUDE")
    if given:
        if not os.path.exists(os.path.join(given, "cusparse.h")):
            raise RuntimeError(f"REPROP_CUSPARSE_INCLUDE={given} has no cusparse.h")
        return given
    for folder in [os.path.join(home, "include"), *nvidia_wheel_dirs("include")]:
        if os.path.exists(os.path.join(folder, "cusparse.h")):
            return folder
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
                   f'-DRP_CUDA_ARCHS="{archs}"', *ext.cuda_flags, *gencode, "-c", src, "-o", obj]
            print(" ".join(cmd))
            subprocess.check_call(cmd)
            objects.append(obj)
        return objects


def cusparse_flags(home):
    """nvcc flags that build the cuSPARSE peer, or none (and why, printed)."""
    folder = cusparse_include(home)
    if folder is None:
        print("reprop: cusparse.h not found: the cuSPARSE peer of the sparse scan is left out "
              "(pip install nvidia-cusparse, or set REPROP_CUSPARSE_INCLUDE, to build it)")
        return []
    print(f"reprop: the cuSPARSE peer of the sparse scan is built with {folder}/cusparse.h")
    # -isystem: searched after the toolkit's own include, so a wheel folder that
    # also holds other CUDA headers (nvidia/cu13/include) cannot shadow them
    return ["-DRP_HAVE_CUSPARSE", "-isystem", folder]


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
        cuda.cuda_flags = cusparse_flags(home)
        exts.append(cuda)
    return exts


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildExt})
