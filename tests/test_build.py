"""setup.py: where the build finds the CUDA runtime, and what it says when something is missing.
(CI builds the core with no toolkit in sight: .ci/run.)"""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def setup_py():
    spec = importlib.util.spec_from_file_location("um_alloc_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not as __main__: nothing is built
    return module


def runtime(root: Path, *, crt: bool = True, library: str = "libcudart.so.13") -> Path:
    """A CUDA runtime laid out as the nvidia wheels lay it out (nvidia/cu13/{include,lib})."""
    (root / "include" / "crt").mkdir(parents=True)
    (root / "include" / "cuda_runtime_api.h").write_text("")
    if crt:
        (root / "include" / "crt" / "host_defines.h").write_text("")
    (root / "lib").mkdir()
    (root / "lib" / library).write_text("")
    return root


def test_the_first_root_with_every_header_and_the_library_wins(setup_py, tmp_path):
    without_crt = runtime(tmp_path / "runtime_only", crt=False)
    wheels = runtime(tmp_path / "wheels")
    include, lib = setup_py.find_cuda_runtime([tmp_path / "absent", without_crt, wheels])
    assert (include, lib) == (str(wheels / "include"), str(wheels / "lib"))


def test_a_runtime_without_crt_headers_names_the_wheel_that_has_them(setup_py, tmp_path):
    without_crt = runtime(tmp_path / "cu13", crt=False)
    with pytest.raises(SystemExit) as info:
        setup_py.find_cuda_runtime([without_crt])
    message = str(info.value)
    assert f"{without_crt} has cuda_runtime_api.h but not crt/host_defines.h (the nvidia-cuda-crt wheel holds it)" \
        in message
    assert "`python -m pip install nvidia-cuda-runtime nvidia-cuda-crt` (no CUDA toolkit needed)" in message


def test_the_wheels_come_before_usr_local_cuda_and_after_cuda_home(setup_py, monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "toolkit"))
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(sys, "path", [str(tmp_path / "site-packages")])
    assert setup_py.cuda_roots() == [tmp_path / "toolkit", tmp_path / "site-packages" / "nvidia" / "cu13",
                                     Path("/usr/local/cuda")]


def test_a_build_that_cannot_see_torch_says_how_to_install(tmp_path):
    # What pip's build isolation does: the build's Python has no torch.
    hide_torch = "import runpy, sys; sys.modules['torch'] = None; runpy.run_path('setup.py', run_name='__main__')"
    done = subprocess.run([sys.executable, "-c", hide_torch, "build_ext"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert done.returncode == 1
    assert "pip's build isolation hid it: install with `python -m pip install --no-build-isolation .`" in done.stderr
    assert "Traceback" not in done.stderr
