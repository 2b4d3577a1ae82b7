"""`python -m um_alloc check|info` and the device queries behind them (faked without a GPU)."""

import ast
import enum
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import um_alloc.__main__ as cli
from um_alloc import device_info
from um_alloc.device_info import DeviceMemory, device_clocks, device_memory, unified_memory_capabilities
from um_alloc.policy import GiB
from conftest import fake_pynvml

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args, cwd=ROOT):
    env = {k: v for k, v in os.environ.items() if k != "UM_POLICY"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "um_alloc", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


# ---------------------------------------------------------------- check, as a user runs it
def test_check_shipped_policies_exit_0():
    result = run_cli("check", "best", "none", ROOT / "policies" / "worst.yaml")
    assert result.returncode == 0, result.stderr
    lines = [l for l in result.stdout.splitlines() if l.startswith("ok  ")]
    assert len(lines) == 3
    assert lines[0].startswith("ok  best  (chunk 2.0 MiB, arena 1.0 GiB")
    assert "parameter=gpu/by:gpu/prefetch" in lines[0] and "input=read_mostly/prefetch" in lines[0]
    assert lines[1].endswith("advice: none)")
    assert "activation=cpu/by:cpu" in lines[2]
    assert "budget none (hard, block planner)" in lines[0] and "budget none (hard)" in lines[1]
    assert result.stderr == ""


@pytest.mark.parametrize("scheduler, mode", [
    ("{budget: 4GiB, evict_live: true}", "reactive"),  # reactive only where the policy asks
    ("{budget: 4GiB, strategy: auto, block_classes: [UNetDown, UNetUp]}", "hard, block planner, blocks: UNetDown, UNetUp"),
    ("{budget: 4GiB, strategy: auto, lean_loss: false}", "hard, block planner, the model's own loss"),
    ("{budget: 4GiB, strategy: auto, recompute_logits: true}", "hard, block planner, logits made again in backward"),
], ids=["reactive", "named-blocks", "own-loss", "logits-made-again"])
def test_check_says_what_a_budget_does_under_the_policy(tmp_path, scheduler, mode):
    policy = tmp_path / "policy.yaml"
    policy.write_text(f"scheduler: {scheduler}\n")
    result = run_cli("check", "--device-memory", "8GiB", policy)
    assert result.returncode == 0, result.stderr
    assert f"budget 4.0 GiB ({mode})" in result.stdout


def test_check_says_where_the_planner_keeps_checkpoint_throughout(tmp_path):
    through = tmp_path / "through_checkpoint.yaml"
    through.write_text("scheduler: {budget: 4GiB, strategy: auto, one_node_recompute: false}\n")
    result = run_cli("check", "--device-memory", "8GiB", through, "planner")
    assert result.returncode == 0, result.stderr
    assert "budget 4.0 GiB (hard, block planner through torch.utils.checkpoint)" in result.stdout
    assert "(hard, block planner)" in result.stdout  # planner.yaml: as one node where a block allows


def test_check_says_where_the_planner_chains_nothing(tmp_path):
    unchained = tmp_path / "no_chains.yaml"
    unchained.write_text("scheduler: {budget: 4GiB, strategy: auto, chains: false}\n")
    result = run_cli("check", "--device-memory", "8GiB", unchained)
    assert result.returncode == 0, result.stderr
    assert "budget 4.0 GiB (hard, block planner, no chains)" in result.stdout


def test_check_reports_every_bad_file_and_exits_1(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("tags:\n  parameter:\n    preferred_location: gpuu\n")
    broken = tmp_path / "broken.yaml"
    broken.write_text("pool: {chunk_size: 2MiB\n")
    result = run_cli("check", bad, "best", broken, tmp_path / "absent.yaml")
    assert result.returncode == 1
    assert "ok  best  (" in result.stdout                       # good files still reported
    err = result.stderr
    assert f"FAIL  {bad}: tags.parameter.preferred_location: invalid value" in err
    assert "got 'gpuu'; allowed: gpu, cpu, none" in err
    assert f"FAIL  {broken}: line 2, column 1: YAML syntax error" in err
    assert "absent.yaml: policy file not found; packaged policies: best, host_optimizer, large_batch, none, offload, planner, worst" in err
    assert "3 of 4 policies failed" in err


def test_check_against_given_device_memory(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("scheduler: {budget: 12GiB}\n")
    small = run_cli("check", "--device-memory", "8GiB", big)
    assert small.returncode == 1
    assert "checking against device memory: --device-memory 8GiB" in small.stdout
    assert "(got '12GiB')" in small.stderr  # the budget as the file writes it, not 12884901888
    assert "scheduler.budget: larger than device memory (8.0 GiB, 8589934592 bytes)" in small.stderr
    large = run_cli("check", "--device-memory", "16GiB", big)
    assert large.returncode == 0 and "budget 12.0 GiB" in large.stdout


@pytest.mark.parametrize("args, fragment", [
    ((), "the following arguments are required: COMMAND"),
    (("check",), "the following arguments are required: FILE"),
    (("frobnicate",), "invalid choice: 'frobnicate'"),
    (("check", "--device-memory", "8GB", "best"), "'8GB' is ambiguous: write 8GiB"),
    (("check", "--device-memory", "0", "best"), "--device-memory: size must be > 0 (got 0; allowed: an integer number "
                                                "of bytes > 0"),
    (("info", "--device", "-1"), "--device: out of range (got -1; allowed: an integer >= 0)"),
])
def test_usage_errors_exit_2(args, fragment):
    result = run_cli(*args)
    assert result.returncode == 2
    assert fragment in result.stderr


# ---------------------------------------------------------------- info, as a user runs it
@pytest.fixture
def no_gpu():
    if device_memory(0) is not None:
        pytest.skip("a GPU is visible to NVML; this test covers GPU-less machines")


def test_info_without_gpu_exits_1(no_gpu):
    result = run_cli("info")
    if result.returncode == 0:           # a device NVML could not see, but CUDA can
        pytest.skip("a CUDA device exists")
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.startswith("um_alloc info: ")
    assert any(reason in result.stderr for reason in (
        "no NVIDIA driver found", "no usable CUDA device", "cuda-bindings is not installed"))


@pytest.mark.gpu
def test_info_on_gpu(cuda_device):
    result = run_cli("info")
    assert result.returncode == 0, result.stderr
    assert "concurrentManagedAccess:" in result.stdout and "compute_capability:" in result.stdout


# ---------------------------------------------------------------- in-process, with a fake device
def test_check_uses_nvml_device(monkeypatch, tmp_path, capsys):
    fake = DeviceMemory(total_bytes=16 * GiB, free_bytes=15 * GiB, used_bytes=GiB, name="FakeGPU")
    monkeypatch.setattr(cli, "device_memory", lambda index: fake)
    policy = tmp_path / "p.yaml"
    policy.write_text("scheduler: {budget: 20GiB}\n")
    assert cli.main(["check", "none", str(policy)]) == 1
    out, err = capsys.readouterr()
    assert "checking against device memory: FakeGPU, 16.0 GiB" in out
    assert "ok  none  (" in out
    assert "larger than device memory (16.0 GiB, 17179869184 bytes)" in err


def test_device_memory_via_fake_nvml(monkeypatch):
    nvml = fake_pynvml({0: (80 * GiB, GiB), 2: (24 * GiB, 0), "GPU-abc": (40 * GiB, 2 * GiB)})
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert device_memory(0) == DeviceMemory(80 * GiB, 79 * GiB, GiB, "GPU 0")
    assert device_memory(1) is None                                  # NVMLError -> None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, GPU-abc")
    assert device_memory(0).total_bytes == 24 * GiB                  # CUDA index 0 = NVML 2
    assert device_memory(1).name == "GPU GPU-abc"
    assert device_memory(2) is None                                  # not visible to CUDA
    assert nvml.calls.count("init") == nvml.calls.count("shutdown") == 5


def test_device_clocks_via_fake_nvml_and_what_it_leaves_out(monkeypatch):
    nvml = fake_pynvml({0: (80 * GiB, GiB), 1: (80 * GiB, 0)})
    nvml.NVML_CLOCK_SM, nvml.NVML_TEMPERATURE_GPU = 1, 0
    nvml.nvmlClocksEventReasonSwPowerCap, nvml.nvmlClocksEventReasonSwThermalSlowdown = 4, 32
    nvml.nvmlDeviceGetClockInfo = lambda h, clock: {0: 1590, 1: 1980}[h] if clock == 1 else pytest.fail("not SM")
    nvml.nvmlDeviceGetMaxClockInfo = lambda h, clock: 1980
    nvml.nvmlDeviceGetTemperature = lambda h, sensor: 71
    nvml.nvmlDeviceGetPowerUsage = lambda h: 612500  # mW

    def reasons(h):
        if h == 1:
            raise nvml.NVMLError("Not Supported")
        return 4 | 32
    nvml.nvmlDeviceGetCurrentClocksEventReasons = reasons
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert device_clocks(0) == {"sm_mhz": 1590, "sm_max_mhz": 1980, "temperature_c": 71, "power_w": 612.5,
                                "held_back_by": ["power_cap", "thermal"]}
    assert device_clocks(1)["held_back_by"] is None and device_clocks(1)["sm_mhz"] == 1980  # one query refused
    del nvml.nvmlDeviceGetPowerUsage                                 # bindings without it
    assert device_clocks(0)["power_w"] is None
    assert device_clocks(2) is None                                  # no such device


def test_device_memory_without_nvml_library(monkeypatch):
    nvml = fake_pynvml({})

    def no_library():
        raise nvml.NVMLError("NVML Shared Library Not Found")
    nvml.nvmlInit = no_library
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert device_memory(0) is None


def fake_cuda_runtime(monkeypatch, *, count_error=None, driver=13000):
    """A cuda.bindings.runtime stand-in for one H200; `count_error` names a cudaError_t."""
    class Err(enum.Enum):
        cudaSuccess = 0
        cudaErrorNoDevice = 100

    ok = Err.cudaSuccess
    attrs = dict.fromkeys(device_info._UM_ATTRIBUTES, 1) | {"cudaDevAttrPageableMemoryAccess": 0}
    rt = types.ModuleType("cuda.bindings.runtime")
    rt.cudaError_t = Err
    rt.cudaDeviceAttr = types.SimpleNamespace(**{name: name for name in attrs})
    rt.cudaGetErrorString = lambda err: (ok, b"no CUDA-capable device is detected")
    rt.cudaDriverGetVersion = lambda: (ok, driver)
    rt.cudaRuntimeGetVersion = lambda: (ok, 13050)
    rt.cudaGetDeviceCount = lambda: (Err[count_error], 0) if count_error else (ok, 1)
    rt.cudaGetDeviceProperties = lambda i: (ok, types.SimpleNamespace(
        name=b"NVIDIA H200\0\0\0", major=9, minor=0))
    rt.cudaDeviceGetPCIBusId = lambda n, i: (ok, b"0000:65:00.0\0")
    rt.cudaDeviceGetAttribute = lambda attr, i: (ok, attrs[attr])
    bindings = types.ModuleType("cuda.bindings")
    bindings.runtime = rt
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    monkeypatch.setitem(sys.modules, "cuda.bindings.runtime", rt)
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml({"0000:65:00.0": (140 * GiB, 4 * GiB)}))


def test_capabilities_via_fake_runtime(monkeypatch, capsys):
    fake_cuda_runtime(monkeypatch)
    caps = unified_memory_capabilities(0)
    assert caps["name"] == "NVIDIA H200" and caps["pci_bus_id"] == "0000:65:00.0"
    assert caps["compute_capability"] == "9.0"
    assert caps["concurrentManagedAccess"] is True and caps["pageableMemoryAccess"] is False
    assert caps["driver_version"] == "13.0" and caps["runtime_version"] == "13.5"
    assert caps["total_bytes"] == 140 * GiB and caps["used_bytes"] == 4 * GiB
    assert caps["sm_mhz"] is None and caps["held_back_by"] is None  # this NVML has no clock queries
    sys.modules["pynvml"].nvmlDeviceGetClockInfo = lambda handle, clock: 1755
    sys.modules["pynvml"].nvmlClocksEventReasonSwPowerCap = 4
    sys.modules["pynvml"].nvmlDeviceGetCurrentClocksEventReasons = lambda handle: 4
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "sm_mhz:                                 1755" in out
    assert "held_back_by:                           power_cap\n" in out
    sys.modules["pynvml"].nvmlDeviceGetCurrentClocksEventReasons = lambda handle: 0
    assert cli.main(["info"]) == 0
    assert "held_back_by:                           nothing\n" in capsys.readouterr().out
    assert "pageableMemoryAccessUsesHostPageTables: True" in out      # the longest key
    assert "total_bytes:                            140.0 GiB (150323855360 bytes)" in out
    with pytest.raises(RuntimeError, match="CUDA device 3 does not exist: 1 device"):
        unified_memory_capabilities(3)


def test_capabilities_errors_name_the_call(monkeypatch):
    fake_cuda_runtime(monkeypatch, count_error="cudaErrorNoDevice")
    with pytest.raises(RuntimeError, match=r"cudaGetDeviceCount failed with cudaErrorNoDevice "
                                           r"\(no CUDA-capable device is detected\)"):
        unified_memory_capabilities(0)
    fake_cuda_runtime(monkeypatch, driver=0)
    with pytest.raises(RuntimeError, match="no NVIDIA driver found"):
        unified_memory_capabilities(0)


# ---------------------------------------------------------------- import hygiene
@pytest.mark.parametrize("module", ["policy.py", "device_info.py", "__main__.py", "tag_names.py", "errors.py",
                                    "sizes.py", "stats_fields.py", "arguments.py"])
def test_modules_import_only_stdlib_and_yaml_at_top_level(module):
    """torch, pynvml and cuda.bindings must be imported lazily: installing the allocator has to
    happen before anything initialises CUDA, and CI has no GPU libraries."""
    tree = ast.parse((ROOT / "um_alloc" / module).read_text())
    top = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            top += [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            top.append(node.module.split(".")[0])
    allowed = set(sys.stdlib_module_names) | {"yaml", "__future__"}
    assert top and set(top) <= allowed, set(top) - allowed


@pytest.mark.parametrize("module, allowed", [
    ("tag_names.py", set()), ("errors.py", set()), ("stats_fields.py", set()), ("sizes.py", {"errors"}),
    ("arguments.py", {"errors", "sizes"}),
    ("_lib.py", {"tag_names", "stats_fields"}), ("pool.py", {"_lib", "tag_names", "stats_fields"}),
])
def test_the_bottom_of_the_package_imports_only_what_lies_below_it(module, allowed):
    """The vocabulary and the C mirror sit at the bottom: nothing they import imports them back."""
    tree = ast.parse((ROOT / "um_alloc" / module).read_text())
    package = {alias.name if node.module is None else node.module
               for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level > 0
               for alias in node.names}
    assert package <= allowed, package - allowed
