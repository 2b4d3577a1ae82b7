"""bench/zoo_train.py and bench/bench_zoo.py on the CPU: the user's script trains each model (two
layers each) with and without Hugging Face's checkpointing of the first k layers, to the same
losses; the benchmark's budgets, its frontier search and its records, with the GPU runs replaced
by a stand-in whose memory falls linearly with k."""
import functools
import sys
from pathlib import Path

import pytest
import torch

from um_alloc.sizes import parse_size  # as zoo_train.py reads --memory-limit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import bench_zoo  # noqa: E402
import zoo_train  # noqa: E402

pytest.importorskip("transformers")

GiB = 1 << 30
LAYERS = {"llama": 2, "t5": 4, "vit": 2, "gpt2": 2, "encoder": 2, "opt": 2, "neox": 2, "qwen2": 2, "bloom": 2,
          "bart": 2}  # t5: two encoder and two decoder blocks; bart: one of each
TINY = sorted(LAYERS)  # torchvision's models (convnext, swin) have no tiny version


@pytest.mark.parametrize("model", TINY)
def test_each_model_trains_and_checkpointing_its_first_layers_gives_the_same_losses(model):
    plain = zoo_train.main(["--model", model, "--tiny", "--cpu", "--steps", "3", "--warmup", "1"])
    first = zoo_train.main(["--model", model, "--tiny", "--cpu", "--steps", "3", "--warmup", "1",
                            "--checkpoint-layers", "1"])
    every = zoo_train.main(["--model", model, "--tiny", "--cpu", "--steps", "3", "--warmup", "1",
                            "--checkpoint-layers", "all"])
    assert (plain["checkpointed_layers"], first["checkpointed_layers"], every["checkpointed_layers"]) == \
        (0, 1, LAYERS[model])
    assert plain["losses"] == first["losses"] == every["losses"]  # recomputation changes no bit on the CPU
    assert plain["losses"][0] > 0 and plain["samples_per_s"] > 0 and plain["device"] == "cpu"


def test_saved_activations_in_host_memory_give_the_same_losses():
    plain = zoo_train.main(["--model", "gpt2", "--tiny", "--cpu", "--steps", "2", "--warmup", "1"])
    on_host = zoo_train.main(["--model", "gpt2", "--tiny", "--cpu", "--steps", "2", "--warmup", "1", "--save-on-cpu"])
    assert on_host["save_on_cpu"] and not plain["save_on_cpu"]
    assert on_host["losses"] == plain["losses"]


def test_the_loops_options_accumulate_freeze_and_name_the_workload():
    run = ["--model", "encoder", "--tiny", "--cpu", "--steps", "2", "--warmup", "1"]
    accumulated = zoo_train.main([*run, "--accumulate", "3"])
    assert accumulated["batch"] == 6 and accumulated["micro_batch"] == 2  # samples an optimizer step takes
    assert accumulated["workload"] == "encoder-tiny-accumulate3-bf16-adamw"
    frozen = zoo_train.main([*run, "--freeze-layers", "1"])
    assert frozen["frozen_layers"] == 1
    model = zoo_train.MODELS["encoder"].build(True)
    embeddings = sum(p.numel() for p in model.embed.parameters())
    first_layer = sum(p.numel() for p in model.encoder.layers[0].parameters())
    assert frozen["trained_parameters"] == frozen["parameters"] - embeddings - first_layer


def test_off_the_gpu_the_clocks_are_not_read():
    run = zoo_train.main(["--model", "gpt2", "--tiny", "--cpu", "--steps", "2", "--warmup", "1"])
    assert run["gpu_clocks"] == {"timed_start": None, "end": None}


def test_the_loop_loss_is_the_models_own_loss_taken_in_the_loop():
    """--loop-loss computes in the loop what transformers' ForCausalLMLoss computes inside the
    model: the same first loss, to rounding (the two sum in other orders)."""
    run = ["--model", "gpt2", "--tiny", "--cpu", "--steps", "2", "--warmup", "1"]
    inside, loop = zoo_train.main(run), zoo_train.main([*run, "--loop-loss"])
    assert loop["loop_loss"] and loop["workload"] == "gpt2-tiny-looploss-bf16-adamw"
    assert loop["losses"][0] == pytest.approx(inside["losses"][0], rel=1e-5)
    with pytest.raises(SystemExit):
        zoo_train.parse_args(["--model", "encoder", "--loop-loss"])  # its loss is the loop's already


def test_pairs_take_one_backward_over_two_forwards_losses():
    """--pairs sums the losses of two batches before one backward; --accumulate 2 takes the same two
    batches' mean with a backward after each, on the same weights: the first steps agree."""
    run = ["--model", "gpt2", "--tiny", "--cpu", "--steps", "2", "--warmup", "1"]
    pairs, accumulated = zoo_train.main([*run, "--pairs"]), zoo_train.main([*run, "--accumulate", "2"])
    assert pairs["forwards_per_backward"] == 2 and pairs["batch"] == 4
    assert pairs["workload"] == "gpt2-tiny-pairs-bf16-adamw"
    assert pairs["losses"][0] == pytest.approx(2 * accumulated["losses"][0], rel=1e-5)


def test_torchvisions_models_say_what_they_need():
    with pytest.raises(SystemExit, match="no --tiny version"):
        zoo_train.MODELS["convnext"].build(True)
    try:
        import torchvision  # noqa: F401
    except ImportError:
        with pytest.raises(SystemExit, match="install torchvision"):
            zoo_train.MODELS["swin"].build(False)


def test_swins_stage_blocks_skip_the_patch_merging_between_stages():
    """torchvision's Swin lays out model.features as stages (Sequentials of blocks) with a
    PatchMerging module between them, which is not a stage and holds no blocks."""
    nn = torch.nn
    SwinTransformerBlock = type("SwinTransformerBlock", (nn.Identity,), {})  # noqa: N806
    PatchMerging = type("PatchMerging", (nn.Identity,), {})  # noqa: N806
    blocks = [SwinTransformerBlock() for _ in range(4)]
    model = nn.Module()
    model.features = nn.Sequential(nn.Sequential(nn.Conv2d(3, 8, 4, 4), nn.LayerNorm(8)),
                                   nn.Sequential(*blocks[:2]), PatchMerging(), nn.Sequential(*blocks[2:]))
    assert zoo_train._stage_blocks(model) == blocks


def test_torchvisions_other_models_name_their_blocks_by_class_in_forward_order():
    """EfficientNet's stages mix MBConv and FusedMBConv; MobileNetV3's blocks sit beside other
    layers in model.features; RegNet's in the stages of model.trunk_output."""
    nn = torch.nn
    kinds = {name: type(name, (nn.Identity,), {}) for name in ("FusedMBConv", "MBConv", "InvertedResidual")}
    stem = nn.Conv2d(3, 8, 3)
    blocks = [kinds["FusedMBConv"](), kinds["FusedMBConv"](), kinds["MBConv"](), kinds["MBConv"]()]
    model = nn.Module()
    model.features = nn.Sequential(stem, nn.Sequential(*blocks[:2]), nn.Sequential(*blocks[2:]), nn.Conv2d(8, 8, 1))
    assert zoo_train.MODELS["efficientnet"].layers(model) == blocks
    model.features = nn.Sequential(stem, kinds["InvertedResidual"](), kinds["InvertedResidual"]())
    assert zoo_train.MODELS["mobilenet"].layers(model) == list(model.features)[1:]


def test_a_densenet_layer_checkpoints_itself_rather_than_under_a_wrapper():
    """A DenseNet layer reads the list its block keeps appending to: its own memory_efficient
    checkpointing is what checkpoints it, for the first K layers only."""
    class DenseLayer(torch.nn.Linear):
        memory_efficient = False

    layers = [DenseLayer(4, 4) for _ in range(3)]
    forwards = [layer.forward for layer in layers]
    assert zoo_train._checkpoint_blocks(layers, "2") == 2
    assert [layer.memory_efficient for layer in layers] == [True, True, False]
    assert [layer.forward for layer in layers] == forwards  # no wrapper around any of them
    plain = torch.nn.Linear(4, 4)
    zoo_train._checkpoint_blocks([plain], "all")
    assert isinstance(plain.forward, functools.partial)


@pytest.mark.parametrize("argv, message", [
    (["--model", "bert"], "invalid choice"),
    (["--model", "gpt2", "--accumulate", "0"], "--accumulate must be at least 1"),
    (["--model", "llama", "--checkpoint-layers", "half"], "a number of layers or 'all'"),
    (["--model", "llama", "--warmup", "12"], "below --steps"),
    (["--model", "llama", "--batch", "0"], "at least 1"),
    (["--model", "vgg", "--checkpoint-layers", "all"], "vgg has no blocks to checkpoint"),
])
def test_the_script_refuses_bad_flags(argv, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        zoo_train.parse_args(argv)
    assert stopped.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--models", "llama,bert"], "unknown bert"),
    (["--fractions", "0.5,1.2"], "between 0 and 1"),
    (["--fractions", "half"], "numbers between 0 and 1"),
])
def test_the_benchmark_refuses_bad_flags(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_zoo.parse_args(argv)
    assert message in capsys.readouterr().err


def test_budgets_are_fractions_of_stocks_peak_rounded_to_256_mib():
    assert bench_zoo.budgets_from(20 * GiB, [0.5, 0.6]) == [10 * GiB, 12 * GiB]
    assert bench_zoo.budgets_from(10 * GiB + (100 << 20), [0.5]) == [5 * GiB]
    assert bench_zoo.budgets_from(100 << 20, [0.1]) == [256 << 20]


def test_the_frontier_guess_interpolates_between_the_two_ends():
    # 24 layers from 20 GiB (none) to 8 GiB (all): 0.5 GiB a layer; 12 GiB minus 8% spare must shed
    # 20 - 11.04 GiB, 18 layers' worth.
    assert bench_zoo.frontier_guess(20 * GiB, 8 * GiB, 24, 12 * GiB) == 18
    assert bench_zoo.frontier_guess(20 * GiB, 8 * GiB, 24, 30 * GiB) == 0
    assert bench_zoo.frontier_guess(None, 8 * GiB, 24, 12 * GiB) == 24


class StandIn:
    """run_train for zoo_train.py runs: k checkpointed layers of 24 hold 20 GiB - k x 0.5 GiB and
    run at 100 - k samples/s; save_on_cpu holds 7 GiB and runs at 60 samples/s; a run fits if what
    it holds is within its --memory-limit. The planner runs at `planner_rate` and reports a plan."""

    def __init__(self, planner_rate=95.0):
        self.planner_rate = planner_rate
        self.runs = []

    def __call__(self, run, timeout):
        args = run.train_args
        self.runs.append(run.name)
        if run.launch:
            report = Path(run.launch[run.launch.index("--json") + 1])
            report.write_text('{"planner": {"plan": {"predicted_step_s": 0.08}, "calibration": {"step_s": 0.1}}, '
                              '"plan_table": "a table"}')
            return self._summary(0, self.planner_rate, 9 * GiB), "ok", ""
        if "--memory-limit" not in args:
            return self._summary(0, 100.0, 20 * GiB), "ok", ""
        limit = parse_size(args[args.index("--memory-limit") + 1], key="--memory-limit", source="command line")
        if "--save-on-cpu" in args:
            k, peak, rate = 0, 7 * GiB, 60.0
        else:
            k = args[args.index("--checkpoint-layers") + 1]
            k = 24 if k == "all" else int(k)
            peak, rate = 20 * GiB - k * GiB // 2, 100.0 - k
        return (self._summary(k, rate, peak), "ok", "") if peak <= limit else (None, "oom", "out of memory")

    @staticmethod
    def _summary(k, rate, peak):
        return {"device": "stand-in", "date": "today", "workload": "llama-bf16-adamw", "batch": 8,
                "step_s_median": 8 / rate, "samples_per_s": rate, "loss_first": 10.0, "loss_last": 9.0,
                "checkpointed_layers": k, "peak_bytes": peak, "device_used_delta_bytes": peak + GiB // 2}


def test_one_model_is_compared_at_each_budget_with_the_fastest_checkpointing_that_fits(monkeypatch):
    stand_in = StandIn()
    monkeypatch.setattr(bench_zoo, "run_train", stand_in)
    args = bench_zoo.parse_args(["--models", "llama", "--fractions", "0.6", "--repeats", "1"])
    records = bench_zoo.compare_model("llama", args, "zoo-test")
    by_method = {r["method"]: r for r in records}
    assert [r["method"] for r in records] == ["stock", "checkpointing", "frontier", "save_on_cpu", "planner"]
    assert {r["run_id"] for r in records} == {"zoo-test"}
    budget = 12 * GiB  # 0.6 of 20 GiB
    assert all(r["budget_bytes"] == budget for r in records[1:]) and by_method["stock"]["budget_bytes"] is None
    # 20 - k/2 <= 12 first holds at k = 16; the search ran k = 15 and found it does not fit.
    assert by_method["frontier"]["checkpointed_layers"] == 16 and 15 in by_method["frontier"]["frontier_tried"]
    assert by_method["frontier"]["samples_per_s"] == 84.0 and by_method["checkpointing"]["samples_per_s"] == 76.0
    assert by_method["planner"]["ratio_vs_fastest_peer"] == pytest.approx(95 / 84)
    assert by_method["planner"]["ratio_vs_stock"] == pytest.approx(0.95)
    assert by_method["planner"]["predicted_step_s"] == 0.08 and by_method["planner"]["plan_table"] == "a table"
    assert by_method["planner"]["calibration"] == {"step_s": 0.1}
    assert by_method["planner"]["highwater_within_budget_plus_1GiB"] is True
    assert by_method["save_on_cpu"]["samples_per_s"] == 60.0
    assert stand_in.runs.count("stock") == 1


def test_a_model_without_blocks_is_compared_with_save_on_cpu_alone(monkeypatch):
    stand_in = StandIn(planner_rate=70.0)
    monkeypatch.setattr(bench_zoo, "run_train", stand_in)
    args = bench_zoo.parse_args(["--models", "vgg", "--fractions", "0.6", "--repeats", "2"])
    records = bench_zoo.compare_model("vgg", args, "zoo-test")
    by_method = {r["method"]: r for r in records}
    assert by_method["checkpointing"]["status"] == by_method["frontier"]["status"] == "no blocks"
    assert not any("--checkpoint-layers" in name for name in stand_in.runs)
    assert stand_in.runs.count("save_on_cpu") == 2 and stand_in.runs.count("planner") == 2
    assert by_method["planner"]["ratio_vs_fastest_peer"] == pytest.approx(70 / 60)


def test_lengths_reach_every_run_and_its_record(monkeypatch):
    stand_in = StandIn()
    seen = []

    def run_train(run, timeout):
        seen.append(run.train_args)
        summary, status, note = stand_in(run, timeout)
        if summary is not None:
            summary = {**summary, "lengths": [512, 1024], "step_s_mean": 0.2, "step_seconds": [0.3, 0.1]}
        return summary, status, note

    monkeypatch.setattr(bench_zoo, "run_train", run_train)
    args = bench_zoo.parse_args(["--models", "llama", "--fractions", "0.6", "--repeats", "1",
                                 "--lengths", "256:1024", "--pad-to", "64"])
    records = bench_zoo.compare_model("llama", args, "zoo-test")
    assert seen and all(a[a.index("--lengths"):a.index("--lengths") + 4] == ["--lengths", "256:1024", "--pad-to", "64"]
                        for a in seen)
    assert all(r["lengths"] == [512, 1024] and r["step_s_mean"] == 0.2 for r in records if r["status"] == "ok")


def test_the_loops_options_reach_every_run_and_name_the_results(monkeypatch, tmp_path):
    seen = []
    stand_in = StandIn()

    def run_train(run, timeout):
        seen.append(run.train_args)
        return stand_in(run, timeout)

    monkeypatch.setattr(bench_zoo, "run_train", run_train)
    out = tmp_path / "results"
    monkeypatch.setattr(bench_zoo, "RESULTS", out)
    assert bench_zoo.main(["--models", "gpt2", "--fractions", "0.6", "--repeats", "1", "--accumulate", "4",
                           "--fp16", "--freeze-layers", "6", "--out", str(out)]) == 0
    assert seen and all(a[-5:] == ["--accumulate", "4", "--fp16", "--freeze-layers", "6"] for a in seen)
    assert [f.name for f in out.iterdir()] == ["zoo_gpt2_accumulate4_fp16_freeze6.json"]


def test_bad_pad_to_is_refused():
    with pytest.raises(SystemExit):
        bench_zoo.parse_args(["--models", "llama", "--pad-to", "0"])


def test_a_budget_that_no_checkpointing_fits_is_recorded_not_searched(monkeypatch):
    stand_in = StandIn()
    monkeypatch.setattr(bench_zoo, "run_train", stand_in)
    args = bench_zoo.parse_args(["--models", "llama", "--fractions", "0.3"])  # 6 GiB: below k = 24's 8 GiB
    records = bench_zoo.compare_model("llama", args, "zoo-test")
    frontier = next(r for r in records if r["method"] == "frontier")
    assert frontier["status"] == "oom" and frontier["samples_per_s"] is None
    assert not any(name.startswith("frontier_k") for name in stand_in.runs)
    planner = next(r for r in records if r["method"] == "planner")
    assert planner["ratio_vs_fastest_peer"] is None and planner["samples_per_s"] == 95.0


def vit_at_0_6(monkeypatch, tmp_path, *flags: str) -> tuple["StandIn", list[dict]]:
    """ViT at 0.6 of stock's peak with `flags`, every run the stand-in's: the runs and the records."""
    stand_in = StandIn()
    monkeypatch.setattr(bench_zoo, "run_train", stand_in)
    args = bench_zoo.parse_args(["--models", "vit", "--fractions", "0.6", *flags])
    args.out_dir = tmp_path
    return stand_in, bench_zoo.compare_model("vit", args, "zoo-test")


def test_the_ablations_run_the_allocator_and_the_planner_recomputing_every_block(monkeypatch, tmp_path):
    _, records = vit_at_0_6(monkeypatch, tmp_path, "--ablations")
    assert [r["method"] for r in records] == ["stock", "um_in_memory", "um_checkpointing", "checkpointing",
                                             "frontier", "save_on_cpu", "planner", "planner_recompute"]
    policy = (tmp_path / "policies" / "planner_recompute.yaml").read_text()
    assert "strategy: checkpoint" in policy
    assert [r["budget_bytes"] for r in records if r["method"].startswith("um_")] == [None, None]
    assert next(r for r in records if r["method"] == "planner_recompute")["budget_bytes"] == 12 * GiB


def test_plain_loss_runs_the_planner_again_with_its_chunked_loss_off(monkeypatch, tmp_path):
    stand_in, records = vit_at_0_6(monkeypatch, tmp_path, "--plain-loss", "--repeats", "2")
    assert [r["method"] for r in records] == ["stock", "checkpointing", "frontier", "save_on_cpu", "planner",
                                             "planner_plain_loss"]
    assert "lean_loss: false" in (tmp_path / "policies" / "planner_plain_loss.yaml").read_text()
    assert stand_in.runs.count("planner_plain_loss") == 2  # alternated with the others, as every timed method
    plain_loss = records[-1]
    assert plain_loss["budget_bytes"] == 12 * GiB and plain_loss["ratio_vs_fastest_peer"] is not None


def test_remade_logits_runs_the_planner_again_with_the_heads_logits_made_again(monkeypatch, tmp_path):
    stand_in, records = vit_at_0_6(monkeypatch, tmp_path, "--remade-logits", "--repeats", "1")
    assert [r["method"] for r in records][-1] == "planner_remade_logits"
    assert "recompute_logits: true" in (tmp_path / "policies" / "planner_remade_logits.yaml").read_text()
    assert stand_in.runs.count("planner_remade_logits") == 1


class Noisy(StandIn):
    """The stand-in, each run's samples/s but save_on_cpu's scaled by the next of `factors` (the
    host's and the clocks' noise); the planner's second run runs out of memory."""

    def __init__(self, factors):
        super().__init__()
        self.factors, self.planner_runs = list(factors), 0

    def __call__(self, run, timeout):
        if run.launch:
            self.planner_runs += 1
            if self.planner_runs == 2:
                self.runs.append(run.name)
                return None, "oom", "out of memory"
        summary, status, note = super().__call__(run, timeout)
        if summary is not None and run.name != "save_on_cpu":
            factor = self.factors.pop(0)
            summary = {**summary, "samples_per_s": summary["samples_per_s"] * factor,
                       "device_used_delta_bytes": summary["device_used_delta_bytes"] + int(factor * GiB)}
        return summary, status, note


def test_repeats_alternate_the_methods_and_record_the_median_of_their_runs(monkeypatch):
    # Stock twice, 12 GiB: every layer, the frontier search (k = 16 fits, 15 does not), the planner,
    # then every layer, k = 16 and the planner again; of the planner's runs the second does not fit.
    stand_in = Noisy([1.0, 1.0, 1.0, 1.0, 1.1, 1.0, 0.8, 0.9, 1.1, 1.0, 1.2, 1.3, 1.0])
    monkeypatch.setattr(bench_zoo, "run_train", stand_in)
    args = bench_zoo.parse_args(["--models", "llama", "--fractions", "0.6", "--repeats", "3"])
    records = {r["method"]: r for r in bench_zoo.compare_model("llama", args, "zoo-test")}
    tail = [name for name in stand_in.runs if name not in ("frontier_k15", "save_on_cpu")][5:]
    assert tail == ["planner", "checkpointing", "frontier_k16", "planner", "checkpointing", "frontier_k16", "planner",
                    "stock", "stock"]
    assert stand_in.runs.count("save_on_cpu") == 3
    assert records["checkpointing"]["samples_per_s_runs"] == pytest.approx([76.0, 76 * 0.8, 76 * 1.1])
    assert records["checkpointing"]["samples_per_s"] == pytest.approx(76.0)
    assert records["frontier"]["samples_per_s"] == pytest.approx(84 * 1.0)  # of 84 x 1.1, 0.9 and 1.0
    planner = records["planner"]
    assert planner["samples_per_s_runs"] == pytest.approx([95.0, None, 95 * 1.2])
    assert planner["samples_per_s"] == pytest.approx(95 * 1.1) and "1 of 3 runs did not end well (oom)" in planner["note"]
    assert planner["highwater_bytes"] == 9 * GiB + GiB // 2 + int(1.2 * GiB)  # the highest of the runs that ended
    stock = records["stock"]
    assert stock["samples_per_s"] == pytest.approx(100 * 1.0) and stock["samples_per_s_runs"] == pytest.approx([100, 130, 100])
    assert records["planner"]["ratio_vs_stock"] == pytest.approx(95 * 1.1 / 100)


def test_the_ablations_run_the_allocator_in_memory_right_after_each_of_stocks_runs(monkeypatch, tmp_path):
    stand_in, records = vit_at_0_6(monkeypatch, tmp_path, "--ablations", "--repeats", "2")
    after_stock = [stand_in.runs[i + 1] for i, name in enumerate(stand_in.runs) if name == "stock"]
    assert after_stock == ["um_in_memory", "um_in_memory"]
    in_memory = next(r for r in records if r["method"] == "um_in_memory")
    assert len(in_memory["samples_per_s_runs"]) == 2
