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


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def torchrun_env(rank: int, world: int, port: int) -> dict:
    """What torchrun sets for each process it starts on one node, with this checkout importable."""
    return {**checkout_env(), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1"}


def start_ranks(script, world: int, *args) -> list:
    """`script ARGS` in `world` processes, each with torchrun's variables for its rank; output piped."""
    import subprocess
    import sys

    port = free_port()
    return [subprocess.Popen([sys.executable, str(script), *map(str, args)], env=torchrun_env(rank, world, port),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(world)]


def wait_all(processes: list, timeout: float) -> None:
    """Waits for every process; kills those still running after `timeout` (a rank whose peer died
    waits for it in its collective), then fails with the output of the first that did not exit 0."""
    import subprocess

    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in processes]
    except subprocess.TimeoutExpired:
        for p in processes:
            p.kill()
        outputs = [p.communicate()[0] for p in processes]
    for p, output in zip(processes, outputs):
        assert p.returncode == 0, output[-3000:]


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


def fake_pynvml(devices):
    """A pynvml stand-in: `devices` maps handle keys (index, UUID, bus id) to (total, used); the
    integer keys count as the devices NVML sees. `memory_asked` lists the devices whose memory was read."""
    import types

    nvml = types.ModuleType("pynvml")
    nvml.calls, nvml.memory_asked = [], []

    class NVMLError(Exception):
        pass

    def handle(key):
        if key not in devices:
            raise NVMLError(f"no device {key!r}")
        return key

    def memory(h):
        nvml.memory_asked.append(h)
        return types.SimpleNamespace(total=devices[h][0], used=devices[h][1], free=devices[h][0] - devices[h][1])

    nvml.NVMLError = NVMLError
    nvml.nvmlInit = lambda: nvml.calls.append("init")
    nvml.nvmlShutdown = lambda: nvml.calls.append("shutdown")
    nvml.nvmlDeviceGetCount = lambda: sum(isinstance(key, int) for key in devices)
    nvml.nvmlDeviceGetHandleByIndex = handle
    nvml.nvmlDeviceGetHandleByUUID = handle
    nvml.nvmlDeviceGetHandleByPciBusId = handle
    nvml.nvmlDeviceGetName = lambda h: f"GPU {h}".encode()          # old bindings: bytes
    nvml.nvmlDeviceGetMemoryInfo = memory
    return nvml


FAKE_GPUS = {0: (80 << 30, 1 << 30), 1: (48 << 30, 8 << 30)}  # (total, used): 79 GiB free, 40 GiB free


def fake_gpu_node(patch):
    """Makes um_alloc.install() work as on a node of two GPUs (FAKE_GPUS: 80 and 48 GiB, seen through a
    stand-in for NVML) on a machine without one, through `patch` (a pytest.MonkeyPatch): the policy,
    budget and device checks run, and so do the device count and the memory lookup; CUDA, the
    core's configuration, PyTorch's allocator swap and what install() changes in torch._C do not.
    The memory report is a stand-in (the pool's statistics need a GPU). Returns the list of
    devices whose memory install() read."""
    import importlib
    import sys

    from um_alloc.integrations import attach

    install_module = importlib.import_module("um_alloc.install")
    nvml = fake_pynvml(FAKE_GPUS)
    patch.setitem(sys.modules, "pynvml", nvml)
    patch.setattr(install_module, "_installation", None)
    patch.setattr(install_module, "_require_cuda_untouched", lambda: None)
    patch.setattr(install_module, "_configure_core", lambda made: None)
    patch.setattr(install_module, "_swap_torch_allocator", lambda: None)
    patch.setattr(install_module, "refuse_cuda_graphs", lambda: None)
    patch.setattr(install_module, "answer_torch_memory_stats", lambda: None)  # torch._C stays PyTorch's
    patch.setattr(install_module, "keep_cudnn_benchmark_off", lambda: None)
    patch.setattr(install_module, "warn_on_memory_fraction", lambda: None)
    patch.setattr(install_module, "answer_memory_history", lambda: None)
    patch.setattr(attach, "memory_stats", lambda: {"live_bytes": 0})
    patch.setattr(attach, "memory_summary", lambda: "um_alloc memory summary (stand-in)")
    return nvml.memory_asked


@pytest.fixture
def fake_install(monkeypatch):
    """fake_gpu_node() for one test, with none of torchrun's variables and no CUDA_VISIBLE_DEVICES
    set. Yields the devices whose memory install() read, one per installation."""
    for name in ("CUDA_VISIBLE_DEVICES", "LOCAL_RANK", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    yield fake_gpu_node(monkeypatch)
