"""python -m um_alloc run on the CPU: flags checked before the script starts, the script run as
Python would run it, and its model and optimizer found, tagged and planned through global hooks.
install() is faked (tests/conftest.py): there is no GPU here."""
import json
import sys
import textwrap

import pytest
import torch

from um_alloc import __main__ as cli
from um_alloc.integrations import launcher
from um_alloc.integrations.launcher import Target, launch

pytest.importorskip("transformers")


@pytest.fixture
def clean_process(monkeypatch):
    """run_target changes sys.argv and sys.path as `python script.py` would: keep them for other tests."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))


def write(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def no_global_hooks() -> bool:
    from torch.nn.modules import module
    from torch.optim import optimizer

    return not (module._global_forward_pre_hooks or module._global_forward_hooks
                or optimizer._global_optimizer_pre_hooks or optimizer._global_optimizer_post_hooks)


# ---------------------------------------------------------------- running the script as Python would
def test_the_script_sees_its_argv_main_and_path_and_keeps_its_exit_status(tmp_path, fake_install, clean_process, capsys):
    script = write(tmp_path, "train.py", """
        import json, sys
        print(json.dumps({"argv": sys.argv, "name": __name__, "path0": sys.path[0]}))
        sys.exit(3)
        """)
    status = cli.main(["run", str(script), "--lr", "3", "-m", "x"])
    out, err = capsys.readouterr()
    seen = json.loads(out.splitlines()[0])
    assert status == 3
    assert seen == {"argv": [str(script), "--lr", "3", "-m", "x"], "name": "__main__", "path0": str(tmp_path)}
    assert "train.py exited with status 3" in err and "memory summary" in err
    assert out.count("\n") == 1  # the report went to stderr: stdout is the script's alone
    assert fake_install == [0] and no_global_hooks()


def test_an_exception_keeps_its_traceback_without_the_launchers_frames(tmp_path, fake_install, clean_process, capsys):
    script = write(tmp_path, "fails.py", """
        def train():
            raise ValueError("loss is nan at step 7")
        train()
        """)
    assert launch(Target(str(script), None, ())) == 1
    err = capsys.readouterr().err
    assert 'fails.py", line 4, in <module>' in err and 'line 3, in train' in err
    assert err.rstrip().endswith("ValueError: loss is nan at step 7")  # the last line, as Python's
    assert "launcher.py" not in err and "runpy" not in err


@pytest.mark.parametrize("code, status, printed", [("None", 0, ""), ("0", 0, ""), ("'stopped early'", 1, "stopped early")])
def test_sys_exit_codes_become_the_status_python_would_give(tmp_path, fake_install, clean_process, capsys,
                                                            code, status, printed):
    script = write(tmp_path, "exits.py", f"import sys\nsys.exit({code})\n")
    assert launch(Target(str(script), None, ())) == status
    assert printed in capsys.readouterr().err


def test_a_module_runs_as_python_m_runs_it(tmp_path, fake_install, clean_process, monkeypatch, capsys):
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    write(package, "train.py", "import json, sys\nprint(json.dumps([__name__, sys.argv]))\n")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["run", "--policy", "best", "-m", "mypkg.train", "--steps", "2"]) == 0
    name, argv = json.loads(capsys.readouterr().out.splitlines()[0])
    assert name == "__main__" and argv == [str(package / "train.py"), "--steps", "2"]
    assert launch(Target(None, "mypkg.nothing", ()), policy="best") == 1
    assert "no module named 'mypkg.nothing'" in capsys.readouterr().err


# ---------------------------------------------------------------- flags checked first
@pytest.mark.parametrize("flags, message", [
    (["--policy", "bestt"], "bestt: policy file not found"),
    (["--budget", "12GB"], "--budget: budget: unknown size unit (got '12GB'"),
    (["--budget", "0"], "budget must be > 0"),
    (["--budget", "1.5"], "fraction out of range (0, 1] (got 1.5"),
    (["--budget", "1KiB"], "an absolute budget must hold at least one chunk (2097152 bytes)"),
])
def test_bad_flags_fail_with_the_policys_errors_before_install(tmp_path, fake_install, clean_process, capsys,
                                                               flags, message):
    script = write(tmp_path, "never.py", "raise SystemExit('the script ran')\n")
    assert cli.main(["run", *flags, str(script)]) == 2
    err = capsys.readouterr().err
    assert message in err and "the script ran" not in err
    assert fake_install == []  # nothing was installed


def test_a_missing_script_a_directory_for_json_and_no_target_are_usage_errors(tmp_path, fake_install, capsys):
    assert cli.main(["run", str(tmp_path / "nope.py")]) == 2
    assert "can't open file" in capsys.readouterr().err
    script = write(tmp_path, "ok.py", "")
    assert cli.main(["run", "--json", str(tmp_path), str(script)]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert cli.main(["run", "--budget", "1GiB"]) == 2
    assert "give a script" in capsys.readouterr().err
    assert fake_install == []


def test_cuda_started_before_the_launcher_is_a_clear_error(tmp_path, fake_install, clean_process, monkeypatch, capsys):
    script = write(tmp_path, "ok.py", "print('ran')\n")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert launch(Target(str(script), None, ())) == 1
    out, err = capsys.readouterr()
    assert "CUDA was initialised before um_alloc could install" in err and "sitecustomize" in err
    assert "ran" not in out


def test_budget_values_read_as_install_takes_them():
    assert launcher.budget_value("12GiB") == "12GiB"
    assert launcher.budget_value("1073741824") == 1 << 30
    assert launcher.budget_value("0.5") == 0.5
    assert launcher.budget_value(None) is None


# ---------------------------------------------------------------- finding, tagging and planning
TRAIN = """
    import json, sys, torch, transformers
    import um_alloc

    config = transformers.BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                                     intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(config)
    teacher = torch.nn.Linear(4, 4).requires_grad_(False)  # no trainable parameters: never the model
    optimizer = torch.optim.AdamW(model.parameters())
    with torch.no_grad():
        model(input_ids=torch.zeros(2, 8, dtype=torch.long))  # evaluation first: not training
    losses = []
    for step in range(int(sys.argv[1])):
        teacher(torch.ones(1, 4))
        ids = torch.randint(0, 97, (4, 16))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    print(json.dumps(losses))
    """


@pytest.fixture
def retags(monkeypatch):
    """The tags retag() is called with, through every path (tag_module, StepTags, the launcher)."""
    import um_alloc.tags as tags_module

    seen, real = [], tags_module.retag

    def recording(obj, name):
        seen.append(name)
        return real(obj, name)

    monkeypatch.setattr(tags_module, "retag", recording)
    monkeypatch.setattr("um_alloc.integrations.auto.retag", recording)
    return seen


def test_under_a_budget_the_trained_model_is_planned_and_tagged(tmp_path, fake_install, clean_process, retags, capsys):
    script = write(tmp_path, "train.py", TRAIN)
    out_json = tmp_path / "out" / "run.json"
    assert cli.main(["run", "--budget", "1GiB", "--json", str(out_json), str(script), "5"]) == 0
    report = json.loads(out_json.read_text())
    assert report["policy"] == "planner" and report["budget_bytes"] == 1 << 30
    assert report["model"] == "BertForMaskedLM" and report["exit_status"] == 0
    assert report["planner"]["blocks"] == 3 and report["planner"]["plan"]["decisions"]
    assert "predicted step" in capsys.readouterr().err  # the plan's table at the end
    assert {"parameter", "gradient", "optimizer_state"} <= set(retags)
    assert no_global_hooks()
    from um_alloc.planner import planner_of
    assert planner_of(torch.nn.Linear(1, 1)) is None


def test_without_a_budget_nothing_is_planned_and_the_losses_are_the_scripts(tmp_path, fake_install, clean_process,
                                                                            retags, capsys):
    script = write(tmp_path, "train.py", TRAIN)
    assert launch(Target(str(script), None, ("3",)), json_path=str(tmp_path / "r.json")) == 0
    launched = json.loads(capsys.readouterr().out.splitlines()[-1])
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["policy"] == "none" and "planner" not in report and report["model"] == "BertForMaskedLM"
    import runpy
    sys.argv = [str(script), "3"]
    plain = runpy.run_path(str(script), run_name="__main__")["losses"]
    assert launched == plain


STEPS_SEEN = """
    import json, torch, transformers
    from torch.nn.modules import module
    from torch.optim import optimizer as optim
    from um_alloc.planner import planner_of

    config = transformers.BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                                     intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = transformers.BertForMaskedLM(config)
    optimizer = torch.optim.AdamW(model.parameters())
    seen = []
    for step in range(4):
        ids = torch.randint(0, 97, (4, 16))
        model(input_ids=ids, labels=ids).loss.backward()  # keyword arguments only, as Trainer calls a model
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seen.append({"planned": planner_of(model).plan is not None,
                     "module_hooks": len(module._global_forward_pre_hooks) + len(module._global_forward_hooks),
                     "optimizer_hooks": len(optim._global_optimizer_pre_hooks) + len(optim._global_optimizer_post_hooks),
                     "step_hooks": len(optimizer._optimizer_step_pre_hooks) + len(optimizer._optimizer_step_post_hooks)})
    print(json.dumps(seen))
    """


def test_the_launchers_steps_are_the_explicit_planners_once_the_model_is_found(tmp_path, fake_install, clean_process,
                                                                               capsys):
    """After the first forward every step runs as under um_alloc.plan() and tag_training(): the
    same calibration (two steps, then the plan, as in test_planner_replay), no global module
    hook left, and per step one pre- and one post-hook around the optimizer's step."""
    script = write(tmp_path, "steps.py", STEPS_SEEN)
    assert launch(Target(str(script), None, ()), budget="1GiB") == 0
    seen = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert [s["planned"] for s in seen] == [False, False, True, True]
    assert all(s["module_hooks"] == 0 for s in seen)
    assert all(s["optimizer_hooks"] + s["step_hooks"] == 2 for s in seen)


TWO_FORWARDS = """
    import json, torch, transformers
    from um_alloc.planner import planner_of

    config = transformers.BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                                     intermediate_size=64, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(config)
    optimizer = torch.optim.AdamW(model.parameters())
    losses, planned = [], []
    for step in range(4):
        ids = torch.randint(0, 97, (4, 16))
        first, second = model(input_ids=ids, labels=ids), model(input_ids=ids, labels=ids)  # two dropout masks
        agree = torch.nn.functional.kl_div(first.logits.log_softmax(-1), second.logits.log_softmax(-1),
                                           log_target=True, reduction="batchmean")
        loss = (first.loss + second.loss) / 2 + agree  # R-Drop's loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        attached = planner_of(model)
        planned.append(attached is not None and attached.plan is not None)
    measured = getattr(planner_of(model), "safe_steps", None)  # None when run plainly
    print(json.dumps({"losses": losses, "planned": planned, "safe_steps": measured}))
    """


def test_a_loop_with_two_forwards_a_step_runs_unchanged_under_the_launcher(tmp_path, fake_install, clean_process,
                                                                           capsys):
    """R-Drop: the model called twice on one batch, one backward over both. Under the launcher the
    two forwards are one step (two steps measure, then the plan), with the script's own losses."""
    script = write(tmp_path, "rdrop.py", TWO_FORWARDS)
    import runpy
    sys.argv = [str(script)]
    runpy.run_path(str(script), run_name="__main__")
    plain = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert launch(Target(str(script), None, ()), budget="1GiB") == 0
    launched = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert launched["losses"] == plain["losses"]
    assert launched["planned"] == [False, False, True, True]
    assert launched["safe_steps"] == 2  # steps, not forwards


def test_a_wrong_first_guess_is_corrected_at_the_first_optimizer_step(tmp_path, fake_install, clean_process, capsys):
    script = write(tmp_path, "two.py", """
        import torch

        class Block(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.linear, self.act = torch.nn.Linear(4, 4), torch.nn.ReLU()

            def forward(self, x):
                return self.act(self.linear(x))

        aux = torch.nn.Linear(4, 4)              # trainable, called first, but no optimizer steps it
        model = torch.nn.Sequential(Block(), Block(), Block())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            aux(torch.ones(1, 4))
            model(torch.ones(2, 4)).sum().backward()
            optimizer.step()
        """)
    assert launch(Target(str(script), None, ()), budget="1GiB", json_path=str(tmp_path / "r.json")) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["model"] == "Sequential" and report["planner"]["blocks"] == 3


def test_the_trainer_example_runs_unchanged_under_the_launcher_and_is_planned(tmp_path, fake_install, clean_process,
                                                                              capsys):
    pytest.importorskip("accelerate")
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "hf_trainer_gpt2.py"
    args = ("--tiny", "--cpu", "--steps", "5", "--batch-size", "2", "--seq-len", "32", "--dropout", "0")
    assert launch(Target(str(example), None, args), budget="1GiB", json_path=str(tmp_path / "r.json")) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["model"] == "GPT2LMHeadModel" and report["planner"]["blocks"] == 2 and report["planner"]["plan"]
    assert len(json.loads(capsys.readouterr().out.splitlines()[-1])["losses"]) == 5


def test_the_trainer_examples_own_checkpointing_takes_the_planners_place_under_todays_name(
        tmp_path, fake_install, clean_process, capsys, recwarn):
    """Trainer's checkpointing switch is passed under the name the installed transformers gives it
    (transformers 5 warns at gradient_checkpointing); the model then recomputes itself, and no
    planner attaches."""
    pytest.importorskip("accelerate")
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "hf_trainer_gpt2.py"
    args = ("--tiny", "--cpu", "--steps", "3", "--batch-size", "2", "--seq-len", "32", "--gradient-checkpointing")
    assert launch(Target(str(example), None, args), budget="1GiB", json_path=str(tmp_path / "r.json")) == 0
    assert "planner" not in json.loads((tmp_path / "r.json").read_text())
    assert not [w for w in recwarn if "checkpointing" in str(w.message) and "deprecated" in str(w.message)]
    assert len(json.loads(capsys.readouterr().out.splitlines()[-1])["losses"]) == 3


ACCELERATE_LOOP = """
    import json, sys, torch, transformers
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, mixed_precision="bf16")  # forward under autocast, outputs made fp32
    config = transformers.GPT2Config(vocab_size=97, n_embd=32, n_layer=3, n_head=2, n_positions=32)  # dropout 0.1
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.utils.data.DataLoader([torch.randint(0, 97, (16,)) for _ in range(8)], batch_size=2)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    model.train()
    losses = []
    for ids in data:
        outputs = model(input_ids=ids, labels=ids)
        accelerator.backward(outputs.loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(outputs.loss.item())
    print(json.dumps(losses))
    """


def test_a_plain_accelerate_loop_runs_unchanged_under_the_launcher_and_is_planned(tmp_path, fake_install,
                                                                                 clean_process, retags, capsys):
    """accelerate's own loop (not Trainer): the model it prepared (its forward wrapped in autocast)
    is found and planned, the AcceleratedOptimizer's state is tagged, and the losses are the
    script's own, dropout's masks replayed in the measuring steps' recomputations."""
    pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    script = write(tmp_path, "accelerate_loop.py", ACCELERATE_LOOP)
    AcceleratorState._reset_state(True)  # accelerate keeps one state a process; each run makes its own
    assert launch(Target(str(script), None, ()), budget="1GiB", json_path=str(tmp_path / "r.json")) == 0
    launched = json.loads(capsys.readouterr().out.splitlines()[-1])
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["model"] == "GPT2LMHeadModel" and report["planner"]["blocks"] == 3
    assert report["planner"]["safe_steps"] == 2 and report["planner"]["plan"]["decisions"]
    assert "optimizer_state" in retags
    import runpy
    AcceleratorState._reset_state(True)
    sys.argv = [str(script)]
    plain = runpy.run_path(str(script), run_name="__main__")["losses"]
    AcceleratorState._reset_state(True)
    assert len(launched) == 4 and launched == plain


def test_the_um_alloc_command_is_the_same_entry_point(tmp_path, fake_install, clean_process, monkeypatch):
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    module, function = project["project"]["scripts"]["um-alloc"].split(":")
    assert (module, function) == ("um_alloc.__main__", "main_exit")
    monkeypatch.setattr(sys, "argv", ["um-alloc", "run", str(write(tmp_path, "s.py", "raise SystemExit(5)\n"))])
    with pytest.raises(SystemExit) as exit_:
        cli.main_exit()
    assert exit_.value.code == 5


def training_script(model_class: str) -> str:
    """Four SGD steps of a model from tests/planner_helpers.py."""
    return f"""
    import torch
    from planner_helpers import {model_class}

    model = {model_class}()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        model(torch.randn(8, 16)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    """


def test_blocks_held_as_attributes_are_planned_with_no_key_in_the_policy(tmp_path, fake_install, clean_process):
    script = write(tmp_path, "train.py", training_script("BlocksAsAttributes"))
    out_json = tmp_path / "run.json"
    assert cli.main(["run", "--budget", "1GiB", "--json", str(out_json), str(script)]) == 0
    report = json.loads(out_json.read_text())
    assert report["model"] == "BlocksAsAttributes" and report["planner"]["blocks"] == 3


def test_blocks_the_search_cannot_find_are_named_in_the_policy(tmp_path, fake_install, clean_process):
    script = write(tmp_path, "train.py", training_script("OneOfEach"))
    policy = tmp_path / "named_blocks.yaml"
    policy.write_text("scheduler: {strategy: auto, block_classes: [Residual, Gated]}\n")
    out_json = tmp_path / "run.json"
    assert cli.main(["run", "--policy", str(policy), "--budget", "1GiB", "--json", str(out_json), str(script)]) == 0
    report = json.loads(out_json.read_text())
    assert report["model"] == "OneOfEach" and report["planner"]["blocks"] == 2


def test_without_them_the_parts_are_planned_as_gaps_and_the_warning_names_the_key(tmp_path, fake_install,
                                                                                   clean_process, caplog):
    script = write(tmp_path, "train.py", training_script("OneOfEach"))
    out_json = tmp_path / "run.json"
    assert cli.main(["run", "--budget", "1GiB", "--json", str(out_json), str(script)]) == 0
    assert json.loads(out_json.read_text())["planner"]["blocks"] == 0
    assert "no repeated blocks found in OneOfEach" in caplog.text
    assert "scheduler.block_classes: [...] in the policy" in caplog.text


def test_a_model_with_nothing_to_plan_runs_under_the_budget_with_a_warning(tmp_path, fake_install, clean_process,
                                                                           caplog):
    script = write(tmp_path, "train.py", training_script("NoSubmodules"))
    assert cli.main(["run", "--budget", "1GiB", str(script)]) == 0
    assert "no planner for NoSubmodules" in caplog.text and "no submodules to plan" in caplog.text
