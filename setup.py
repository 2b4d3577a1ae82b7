"""Builds the C++ core (csrc/) into um_alloc/_core*.so next to the Python package.

It compiles with g++ against the CUDA runtime headers and PyTorch's c10 headers (for
c10::OutOfMemoryError only); no nvcc and no CUDA toolkit are needed. What the build needs:

- the PyTorch you run, imported here: install with `pip install --no-build-isolation .`, since
  pip's build isolation would hide it (or build against another one);
- the CUDA 13 runtime: headers and libcudart, from CUDA_HOME or CUDA_PATH when set, else the
  nvidia-cuda-runtime and nvidia-cuda-crt wheels (the runtime wheel lacks crt/host_defines.h,
  which cuda_runtime_api.h includes), else /usr/local/cuda.
"""
import os
import sys
from glob import glob
from pathlib import Path

CUDA_WHEELS = "nvidia-cuda-runtime nvidia-cuda-crt"
REQUIRED_HEADERS = ("cuda_runtime_api.h", "crt/host_defines.h")


def cuda_roots() -> list[Path]:
    """Where a CUDA runtime may be, in the order it is chosen. The wheels come before
    /usr/local/cuda: a CUDA build of PyTorch loads the wheel's libcudart, and the core must
    share it."""
    explicit = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    wheels = [str(Path(p) / "nvidia" / "cu13") for p in sys.path if p]
    return [Path(root) for root in [*explicit, *wheels, "/usr/local/cuda"] if root]


def find_cuda_runtime(roots: list[Path]) -> tuple[str, str]:
    """(include dir, library dir) of the first root with every header and libcudart.so."""
    for root in roots:
        include = root / "include"
        libraries = [root / lib for lib in ("lib64", "lib") if glob(str(root / lib / "libcudart.so*"))]
        if libraries and all((include / header).exists() for header in REQUIRED_HEADERS):
            return str(include), str(libraries[0])
    sys.exit(_not_found(roots))


def _not_found(roots: list[Path]) -> str:
    """What was looked for and where, and the command that installs it."""
    partial = [str(r) for r in roots if (r / "include" / REQUIRED_HEADERS[0]).exists()]
    missing = (f" {partial[0]} has cuda_runtime_api.h but not crt/host_defines.h (the nvidia-cuda-crt "
               "wheel holds it).") if partial else ""
    return (f"um_alloc: no CUDA 13 runtime found: the build needs {' and '.join(REQUIRED_HEADERS)} and "
            f"libcudart.so, and looked in {', '.join(map(str, roots))}.{missing} Install them with "
            f"`python -m pip install {CUDA_WHEELS}` (no CUDA toolkit needed), or set CUDA_HOME to a CUDA 13 "
            "toolkit.")


def import_torch_build_tools():
    try:
        from torch.utils import cpp_extension
    except ImportError:
        sys.exit("um_alloc: building the C++ core needs PyTorch (its c10 headers and libraries), and this "
                 "Python has none. If PyTorch is installed, pip's build isolation hid it: install with "
                 "`python -m pip install --no-build-isolation .` (add -e for a checkout you edit), in the "
                 "environment that holds PyTorch. If it is not, `python -m pip install torch` first.")
    return cpp_extension


def main() -> None:
    from setuptools import setup

    cpp_extension = import_torch_build_tools()
    cuda_include, cuda_lib = find_cuda_runtime(cuda_roots())
    print(f"um_alloc: CUDA runtime headers from {cuda_include}, libcudart from {cuda_lib}")
    libcudart = sorted(Path(cuda_lib).glob("libcudart.so.*"))
    # Link the versioned soname so the process shares the runtime PyTorch already loaded.
    cudart = f"-l:{libcudart[0].name}" if libcudart else "-lcudart"
    setup(
        ext_modules=[
            cpp_extension.CppExtension(
                name="um_alloc._core",
                sources=sorted(glob("csrc/*.cpp")),
                include_dirs=[cuda_include, "csrc"],
                extra_compile_args=["-O2", "-std=c++17", "-Wall", "-Wextra", "-Wno-unused-parameter"],
                extra_link_args=[f"-L{cuda_lib}", cudart, f"-Wl,-rpath,{cuda_lib}"]
                + [f"-Wl,-rpath,{p}" for p in cpp_extension.library_paths()],
            )
        ],
        cmdclass={"build_ext": cpp_extension.BuildExtension},
    )


if __name__ == "__main__":  # setuptools' build backend runs this file as __main__; tests import it
    main()
