import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped where there is none")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.fixture
def cuda_device():
    """Skips the test (inside the fixture, never at import) where no CUDA device exists."""
    if not _cuda_available():
        pytest.skip("no CUDA device")
    return 0


def run_gpu_script(script, *args, timeout: float = 600) -> dict:
    """Runs a script of tests/gpu_scripts in a fresh process (um_alloc installs before CUDA starts),
    with this checkout importable, and returns the JSON object it prints last."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def fake_install(monkeypatch):
    """um_alloc.install() as on an 80 GiB GPU, on a machine without one: the policy, budget and
    device checks run; CUDA, the core's configuration and PyTorch's allocator swap do not. The
    memory report is a stand-in (the pool's statistics need a GPU). Yields the calls to install()."""
    import importlib

    from um_alloc.device_info import DeviceMemory
    from um_alloc.integrations import attach

    install_module = importlib.import_module("um_alloc.install")
    calls = []
    monkeypatch.setattr(install_module, "_installation", None)
    monkeypatch.setattr(install_module, "_require_cuda_untouched", lambda: None)
    monkeypatch.setattr(install_module, "_device_memory_or_raise",
                        lambda device: calls.append(device) or DeviceMemory(80 << 30, 79 << 30, 1 << 30, "fake GPU"))
    monkeypatch.setattr(install_module, "_configure_core", lambda made: None)
    monkeypatch.setattr(install_module, "_swap_torch_allocator", lambda: None)
    monkeypatch.setattr(install_module, "refuse_cuda_graphs", lambda: None)
    monkeypatch.setattr(attach, "memory_stats", lambda: {"live_bytes": 0})
    monkeypatch.setattr(attach, "memory_summary", lambda: "um_alloc memory summary (stand-in)")
    yield calls
