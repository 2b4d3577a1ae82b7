"""Each process's GPU under torchrun, on the CPU: install() takes LOCAL_RANK's device (or the one
named), checks it against the GPUs NVML counts and sizes its cap from that GPU's free memory;
``python -m um_alloc run`` does the same in every process torchrun starts. NVML and install() are
faked (conftest.fake_gpu_node): GPU 0 has 80 GiB with 79 free, GPU 1 48 GiB with 40 free."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import checkout_env, fake_pynvml

import um_alloc
from um_alloc import device_info, ranks
from um_alloc import __main__ as cli
from um_alloc.errors import At, PolicyError
from um_alloc.integrations.launcher import Target, launch

GiB = 1 << 30
MARGIN = 2 * GiB  # pool.reserve_margin's default
AT = At("install()", "device")
TORCHRUN_RANK_1 = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
                   "ROLE_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "none"}


@pytest.fixture
def clean_process(monkeypatch):
    """run_target changes sys.argv and sys.path as `python script.py` would: keep them for other tests."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))


def nvml_calls() -> list:
    return sys.modules["pynvml"].calls


# ---------------------------------------------------------------- choosing the device
def test_the_named_device_comes_first_then_local_rank_then_0(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert ranks.choose_device(None, AT) == ranks.ChosenDevice(0, "the default")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert ranks.choose_device(None, AT) == ranks.ChosenDevice(1, "LOCAL_RANK=1", from_local_rank=True)
    assert ranks.choose_device(0, AT) == ranks.ChosenDevice(0, "device=0")


@pytest.mark.parametrize("value", ["abc", "-1", "", "1.5", " 1", "+1", "1_0", "\u0663"])  # the last: an Arabic-Indic 3
def test_a_local_rank_that_is_not_a_whole_number_is_refused_naming_it(monkeypatch, value):
    monkeypatch.setenv("LOCAL_RANK", value)
    expected = (f"environment variable: LOCAL_RANK: not a whole number (got {value!r}; allowed: an integer >= 0, "
                "as torchrun sets it for each process)")
    with pytest.raises(PolicyError) as error:
        ranks.choose_device(None, AT)
    assert str(error.value) == expected


def test_rank_is_read_the_same_way(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert ranks.global_rank() == 0
    monkeypatch.setenv("RANK", "3")
    assert ranks.global_rank() == 3
    monkeypatch.setenv("RANK", "three")
    with pytest.raises(PolicyError, match="RANK: not a whole number"):
        ranks.global_rank()


@pytest.mark.parametrize("device", [-1, True, "1", 1.0])
def test_a_bad_device_argument_is_refused_as_before(device):
    with pytest.raises(PolicyError, match=r"install\(\): device: "):
        ranks.choose_device(device, AT)


@pytest.mark.parametrize("visible, count", [(None, 2), ("0,1", 2), ("1", 1), ("1,0", 2), ("0,7,1", 1), ("", 0),
                                            ("GPU-abc,0", 2), ("-1", 0)])
def test_visible_devices_are_counted_as_cuda_counts_them(monkeypatch, visible, count):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml({0: (GiB, 0), 1: (GiB, 0), "GPU-abc": (GiB, 0)}))
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert device_info.visible_device_count() == count


def test_no_nvml_counts_nothing(monkeypatch):
    nvml = fake_pynvml({0: (GiB, 0)})

    def no_library():
        raise nvml.NVMLError("NVML Shared Library Not Found")
    nvml.nvmlInit = no_library
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert device_info.visible_device_count() is None


# ---------------------------------------------------------------- install() in each rank
def test_under_torchrun_install_takes_local_ranks_gpu_and_that_gpus_free_memory(fake_install, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    made = um_alloc.install("none")
    assert made.device == 1 and fake_install == [1]  # NVML was asked about GPU 1 only
    assert (made.device_total, made.device_free_at_install) == (48 * GiB, 40 * GiB)
    assert made.max_reserved == 40 * GiB - MARGIN    # the cap from GPU 1's free memory, not GPU 0's


def test_the_budget_is_this_processs_own_and_a_fraction_is_of_its_gpu(fake_install, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert um_alloc.install("planner", budget=0.25).budget == 12 * GiB  # a quarter of GPU 1's 48 GiB


def test_a_named_device_comes_before_local_rank(fake_install, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    made = um_alloc.install("none", device=0)
    assert made.device == 0 and fake_install == [0] and made.max_reserved == 79 * GiB - MARGIN


def test_a_local_rank_beyond_the_visible_gpus_is_refused_before_any_memory_is_read(fake_install, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(RuntimeError) as error:
        um_alloc.install("none")
    assert str(error.value) == (
        "um_alloc: CUDA device 2 (LOCAL_RANK=2) does not exist: this process sees 2 GPU(s), devices 0 to 1; start at "
        "most 2 processes per node (torchrun --nproc-per-node 2), or where the launcher gives each process a GPU of "
        "its own through CUDA_VISIBLE_DEVICES, name it: install(device=0), or python -m um_alloc run --device 0")
    assert fake_install == [] and not um_alloc.is_installed()


def test_a_named_device_beyond_the_visible_gpus_names_the_range(fake_install):
    with pytest.raises(RuntimeError, match=r"CUDA device 5 \(device=5\) does not exist: this process sees 2 GPU\(s\), "
                                           r"devices 0 to 1; name a device from 0 to 1"):
        um_alloc.install("none", device=5)


def test_one_gpu_a_process_through_cuda_visible_devices(fake_install, monkeypatch):
    """Some launchers give each process its own GPU as device 0 and still set LOCAL_RANK."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with pytest.raises(RuntimeError, match=r"sees 1 GPU\(s\), devices 0 to 0 \(CUDA_VISIBLE_DEVICES='1'\); .*"
                                           r"name it: install\(device=0\)"):
        um_alloc.install("none")
    made = um_alloc.install("none", device=0)
    assert fake_install == [1] and made.device_free_at_install == 40 * GiB  # CUDA's 0 is NVML's 1


def test_a_bad_local_rank_is_refused_before_nvml_is_asked(fake_install, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "one")
    with pytest.raises(PolicyError, match="LOCAL_RANK: not a whole number"):
        um_alloc.install("none")
    assert nvml_calls() == [] and not um_alloc.is_installed()


# ---------------------------------------------------------------- the launcher in torchrun's environment
def write(tmp_path, name, body) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


SHOWS_ITSELF = """
    import json, os, sys
    print(json.dumps({"argv": sys.argv, "rank": os.environ["RANK"], "world": os.environ["WORLD_SIZE"]}))
    sys.exit(int(os.environ["RANK"]) + 2)
    """


def test_the_launcher_in_torchruns_rank_1(tmp_path, fake_install, clean_process, monkeypatch, capsys):
    for name, value in TORCHRUN_RANK_1.items():
        monkeypatch.setenv(name, value)
    script = write(tmp_path, "train.py", SHOWS_ITSELF)
    out = tmp_path / "out.json"
    status = cli.main(["run", "--budget", "1GiB", "--json", str(out), str(script), "--budget", "9", "--device", "x"])
    printed, err = capsys.readouterr()
    assert status == 3  # the script's own
    assert json.loads(printed.splitlines()[0]) == {"argv": [str(script), "--budget", "9", "--device", "x"],
                                                   "rank": "1", "world": "2"}
    assert fake_install == [1]
    report = json.loads((tmp_path / "out.rank1.json").read_text())
    assert (report["rank"], report["device"], report["budget_bytes"]) == (1, 1, GiB)  # the budget is rank 1's
    assert not out.exists() and "exited with status 3 (rank 1)" in err


def test_the_device_flag_comes_before_local_rank(tmp_path, fake_install, clean_process, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert cli.main(["run", "--device", "0", str(write(tmp_path, "ok.py", ""))]) == 0
    assert fake_install == [0]


@pytest.mark.parametrize("name, value", [("LOCAL_RANK", "x"), ("LOCAL_RANK", "-1"), ("RANK", "1.0")])
def test_bad_torchrun_variables_stop_the_launcher_before_the_script(tmp_path, fake_install, clean_process,
                                                                    monkeypatch, capsys, name, value):
    monkeypatch.setenv(name, value)
    script = write(tmp_path, "never.py", "raise SystemExit('the script ran')\n")
    assert launch(Target(str(script), None, ())) == 2
    err = capsys.readouterr().err
    assert f"um_alloc run: environment variable: {name}: not a whole number (got {value!r}" in err
    assert "the script ran" not in err and fake_install == []


def test_a_local_rank_without_its_gpu_stops_the_launcher_before_the_script(tmp_path, fake_install, clean_process,
                                                                           monkeypatch, capsys):
    monkeypatch.setenv("LOCAL_RANK", "2")
    script = write(tmp_path, "never.py", "raise SystemExit('the script ran')\n")
    assert launch(Target(str(script), None, ())) == 1
    err = capsys.readouterr().err
    assert "um_alloc run: um_alloc could not install: um_alloc: CUDA device 2 (LOCAL_RANK=2) does not exist" in err
    assert "the script ran" not in err


DDP_TRAIN = """
    import json, sys, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear, self.act = torch.nn.Linear(8, 8), torch.nn.ReLU()

        def forward(self, x):
            return self.act(self.linear(x))

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(Block(), Block(), Block()))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for step in range(int(sys.argv[2])):
        loss = model(torch.randn(4, 8, generator=data)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    with open(f"seen.rank{dist.get_rank()}.json", "w") as seen:  # a file: both ranks print to one pipe
        json.dump({"argv": sys.argv[1:], "steps": len(losses)}, seen)
    dist.destroy_process_group()
    """


def test_torchrun_starts_the_launcher_in_each_process_and_ddp_trains_planned(tmp_path):
    """torchrun itself, two processes, the gloo backend: each runs the launcher (fake_gpu_run.py is
    ``-m um_alloc`` with install() faked), installs on its own GPU, and plans the model DDP wraps."""
    script = write(tmp_path, "train.py", DDP_TRAIN)
    tests = Path(__file__).resolve().parent
    env = checkout_env()
    env["PYTHONPATH"] = f"{env['PYTHONPATH']}:{tests}"
    env.update(OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")  # a rank that aborts prints every thread's stack
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "fake_gpu_run", "run", "--budget", "1GiB", "--json", str(tmp_path / "r.json"),
                           str(script), "--steps", "4"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-10000:]
    for rank, name in enumerate(["r.json", "r.rank1.json"]):
        assert json.loads((tmp_path / f"seen.rank{rank}.json").read_text()) == {"argv": ["--steps", "4"], "steps": 4}
        report = json.loads((tmp_path / name).read_text())
        assert (report["rank"], report["device"], report["exit_status"]) == (rank, rank, 0)
        assert report["model"] == "Sequential" and report["planner"]["blocks"] == 3  # what DDP wraps
        assert report["planner"]["plan"]["decisions"]
