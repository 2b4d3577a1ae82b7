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
