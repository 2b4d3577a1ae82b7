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


def checkout_env() -> dict:
    """This process's environment with this checkout first on PYTHONPATH."""
    import os
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}


def run_gpu_script(script, *args, timeout: float = 600) -> dict:
    """Runs a script of tests/gpu_scripts in a fresh process (um_alloc installs before CUDA starts),
    with this checkout importable, and returns the JSON object it prints last."""
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=checkout_env())
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def interrupt_when_paused(script, *args, directory, timeout: float = 600) -> tuple[int | None, str]:
    """Runs `script` (tests/gpu_scripts/interrupted_train.py) with --paused, sends it SIGINT once it
    has paused, and returns (exit status, its stderr); None for a status if it had to be killed.
    Its output goes to files in `directory`: a full pipe would stall it before it paused."""
    import signal
    import subprocess
    import sys
    import time

    paused = directory / "paused"
    with open(directory / "stdout", "w") as out, open(directory / "stderr", "w") as err:
        child = subprocess.Popen([sys.executable, str(script), "--paused", str(paused), *map(str, args)],
                                 stdout=out, stderr=err, env=checkout_env())
        deadline = time.monotonic() + timeout
        while not paused.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if paused.exists():
            child.send_signal(signal.SIGINT)
        try:
            status = child.wait(timeout=120)  # an interrupted run that does not end within it hangs
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            status = None
    return status, (directory / "stderr").read_text()


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
