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
