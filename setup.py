"""Builds the C++ core (csrc/) into um_alloc/_core*.so next to the Python package.

It compiles with g++ against the CUDA runtime headers and PyTorch's c10 headers (for
c10::OutOfMemoryError only); no nvcc is needed. Install with `pip install --no-build-isolation .`
so the build sees the PyTorch you have instead of downloading another one.
"""
import os
import sys
from glob import glob
from pathlib import Path

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension, library_paths


def find_cuda_runtime() -> tuple[str, str]:
    """Returns (include dir, library dir) of a CUDA 13 runtime: CUDA_HOME, the toolkit, or the wheel."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    candidates += [str(Path(p) / "nvidia" / "cu13") for p in sys.path if p]
    for root in filter(None, candidates):
        include = Path(root) / "include"
        if (include / "cuda_runtime_api.h").exists():
            for lib in ("lib64", "lib"):
                if glob(str(Path(root) / lib / "libcudart.so*")):
                    return str(include), str(Path(root) / lib)
    sys.exit(
        "um_alloc: no CUDA runtime found (cuda_runtime_api.h and libcudart.so). Looked in "
        f"{[c for c in candidates if c][:4]}... Set CUDA_HOME to a CUDA 13 toolkit, or install "
        "the nvidia-cuda-runtime wheel."
    )


cuda_include, cuda_lib = find_cuda_runtime()
libcudart = sorted(Path(cuda_lib).glob("libcudart.so.*"))
# Link the versioned soname so the process shares the runtime PyTorch already loaded.
cudart = f"-l:{libcudart[0].name}" if libcudart else "-lcudart"

setup(
    ext_modules=[
        CppExtension(
            name="um_alloc._core",
            sources=sorted(glob("csrc/*.cpp")),
            include_dirs=[cuda_include, "csrc"],
            extra_compile_args=["-O2", "-std=c++17", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            extra_link_args=[f"-L{cuda_lib}", cudart, f"-Wl,-rpath,{cuda_lib}"]
            + [f"-Wl,-rpath,{p}" for p in library_paths()],
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
