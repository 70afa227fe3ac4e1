"""The benchmarks' correctness checks flag deliberately wrong candidates.

A wrong candidate is also "fast", so every benchmark compares what its
candidates compute with torch's; these tests hand each check a candidate that
is wrong in a way a weak check misses (a dropped weight decay, a skipped step,
negated gradients, a sign-flipped derivative, ...) and read the report the
benchmark prints, as a user would, on small inputs.
"""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import harness  # noqa: E402
import optim as optim_bench  # noqa: E402

import reprop.optim  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def machine() -> dict:
    return harness.machine_info(CPU)


# ---------------------------------------------------------------------------
# optim.py
# ---------------------------------------------------------------------------

# A model-like set of small tensors; 25 timed rounds after 3 warm-ups (the full CPU run's), so a
# candidate skipping one step in a run skips one of 29.
OPTIM_SHAPES = [torch.Size([16, 3, 3, 3]), torch.Size([16]), torch.Size([10, 16])]
OPTIM_ARGS = SimpleNamespace(device="cpu", reps=25, warmup=3, min_sample_ms=0.0)


class AdamWWithoutWeightDecay(reprop.optim.AdamW):
    """Wrong: AdamW that ignores its weight_decay (Adam's update)."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **{**kwargs, "weight_decay": 0.0})


class SGDSkippingSecondStep(reprop.optim.SGD):
    """Wrong: SGD whose second step() does nothing."""

    def step(self, closure=None):
        self.calls = getattr(self, "calls", 0) + 1
        return None if self.calls == 2 else super().step(closure)


class AdamWWithWrongBeta1(reprop.optim.AdamW):
    """Wrong: AdamW with beta1 0.8 for the 0.9 asked."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **{**kwargs, "betas": (0.8, 0.999)})


class AdamWithWrongBeta2(reprop.optim.Adam):
    """Wrong: Adam with beta2 0.99 for the 0.999 asked."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **{**kwargs, "betas": (0.9, 0.99)})


def optim_report(name: str, machine: dict, capsys) -> str:
    """optim.py's printed report of one small case of optimizer ``name``."""
    spec = optim_bench.OPTIMIZERS[name]
    pset = optim_bench.ParamSet("model", "small", OPTIM_SHAPES)
    result = optim_bench.run_case(name, spec, pset, CPU, OPTIM_ARGS, with_reprop=True)
    capsys.readouterr()
    optim_bench.print_report([result], {name: spec}, [], machine, OPTIM_ARGS)
    return capsys.readouterr().out


@pytest.mark.parametrize("name, wrong", [("adamw", AdamWWithoutWeightDecay), ("sgd", SGDSkippingSecondStep)])
def test_optim_flags_a_wrong_update(name, wrong, machine, capsys, monkeypatch):
    # At the timed lr 1e-6, 1 - lr * weight_decay is 1.0 in fp32 and one step of 29 moved the
    # parameters 3% of the run's total: both passed the old check (5% of the total movement).
    monkeypatch.setattr(reprop.optim, optim_bench.OPTIMIZERS[name].cls, wrong)
    report = optim_report(name, machine, capsys)
    assert "WARNING: not the same update" in report


@pytest.mark.parametrize("name, wrong", [("adamw", AdamWWithWrongBeta1), ("adam", AdamWithWrongBeta2)])
def test_optim_flags_wrong_betas(name, wrong, machine, capsys, monkeypatch):
    # The check stepped on one gradient throughout, with which Adam's bias-corrected moments are g
    # and g^2 whatever the betas: both passed.
    monkeypatch.setattr(reprop.optim, optim_bench.OPTIMIZERS[name].cls, wrong)
    report = optim_report(name, machine, capsys)
    assert "WARNING: not the same update" in report


@pytest.mark.parametrize("name", list(optim_bench.OPTIMIZERS))
def test_optim_accepts_reprop(name, machine, capsys):
    report = optim_report(name, machine, capsys)
    assert "(|p| + largest update)): ok" in report


# ---------------------------------------------------------------------------
# fusion.py
# ---------------------------------------------------------------------------

import fusion as fusion_bench  # noqa: E402


def small_net() -> torch.nn.Module:
    """Conv, BatchNorm, Dropout and Linear: the kinds of MobileNetV2's layers, small."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Dropout(0.2),
                               torch.nn.Linear(8, 1000))  # make_batch draws ImageNet labels


def fusion_report(optimizer: str, machine: dict, capsys, monkeypatch, wrong: str | None = None) -> str:
    """fusion.py's printed report of one case on small_net, candidate ``wrong`` training on -gradients."""
    make_trainer = fusion_bench.make_trainer

    def maybe_wrong(name, *args, **kwargs):
        trainer = make_trainer(name, *args, **kwargs)
        if name == wrong:
            for p in trainer.model.parameters():
                p.register_hook(torch.neg)
        return trainer

    monkeypatch.setattr(fusion_bench, "make_trainer", maybe_wrong)
    monkeypatch.setattr(fusion_bench.models, "build", lambda name: small_net())
    monkeypatch.setattr(fusion_bench, "measure_peaks", lambda *args: None)  # not what is tested here
    args = SimpleNamespace(device="cpu", reps=3, warmup=1, image_size=16, baselines_only=False, batch=4)
    case = fusion_bench.Case("mobilenet_v2", 4, optimizer)
    result = fusion_bench.run_case(case, ["optims"], CPU, args)
    capsys.readouterr()
    names = fusion_bench.candidate_names(False)
    fusion_bench.print_report([result], names, [], machine, args)
    return capsys.readouterr().out


@pytest.mark.parametrize("wrong", [fusion_bench.BACKWARD, fusion_bench.EAGER])
def test_fusion_flags_negated_gradients(wrong, machine, capsys, monkeypatch):
    # The old check compared the total movement sum |p - p0| with torch foreach's: training on
    # negated gradients moves the parameters as far (0.997x on MobileNetV2), and passed.
    report = fusion_report("adamw", machine, capsys, monkeypatch, wrong=wrong)
    assert f"WARNING: mobilenet_v2 b4 AdamW {wrong}: not the parameters" in report


def test_fusion_times_and_checks_torchs_optimizer_in_backward(machine, capsys, monkeypatch):
    # Backward-fusion was compared with eager torch steps only: torch's own optimizer-in-backward
    # (per-parameter optimizers stepped in post-accumulate-grad hooks) was not a candidate.
    report = fusion_report("adamw", machine, capsys, monkeypatch, wrong=fusion_bench.TORCH_BACKWARD)
    assert "x torch bwd" in report and "BF x torch bwd" in report
    assert (f"WARNING: mobilenet_v2 b4 AdamW {fusion_bench.TORCH_BACKWARD}: not the parameters "
            f"{fusion_bench.FOREACH} has") in report


class SGDWithoutMomentum(reprop.optim.SGD):
    """Wrong: SGD that ignores its momentum."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **{**kwargs, "momentum": 0.0})


@pytest.mark.parametrize("optimizer, wrong", [("adamw", AdamWWithWrongBeta1), ("sgd", SGDWithoutMomentum)])
def test_fusion_flags_wrong_betas_or_momentum(optimizer, wrong, machine, capsys, monkeypatch):
    # reprop eager was compared with torch foreach after one step, which is the same with any betas
    # or momentum: both passed.
    monkeypatch.setattr(reprop.optim, fusion_bench.OPTIMIZERS[optimizer].cls, wrong)
    report = fusion_report(optimizer, machine, capsys, monkeypatch)
    label = f"mobilenet_v2 b4 {fusion_bench.OPTIMIZERS[optimizer].cls}"
    assert f"WARNING: {label} {fusion_bench.EAGER}: not the parameters" in report


def test_optim_run_exits_1_on_a_wrong_update(capsys, monkeypatch):
    # It printed the WARNING and exited with status 0.
    monkeypatch.setattr(reprop.optim, "SGD", SGDWithoutMomentum)
    monkeypatch.setattr(sys, "argv", ["optim.py", "--only", "sgd", "--numel", "1000", "--reps", "1", "--warmup", "0"])
    with pytest.raises(SystemExit) as exit_:
        optim_bench.main()
    assert exit_.value.code == 1 and "WARNING: sgd / 1x0.001M" in capsys.readouterr().out


def test_fusion_run_exits_1_on_a_wrong_update(capsys, monkeypatch):
    # It printed the WARNING and exited with status 0.
    monkeypatch.setattr(reprop.optim, "SGD", SGDWithoutMomentum)
    monkeypatch.setattr(fusion_bench.models, "build", lambda name: small_net())
    monkeypatch.setattr(fusion_bench, "measure_peaks", lambda *args: None)
    monkeypatch.setattr(sys, "argv", ["fusion.py", "--sweeps", "optims", "--optims", "sgd", "--batch", "4",
                                      "--image-size", "16", "--reps", "1", "--warmup", "1"])
    with pytest.raises(SystemExit) as exit_:
        fusion_bench.main()
    assert exit_.value.code == 1 and f"{fusion_bench.EAGER}: not the parameters" in capsys.readouterr().out


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_fusion_accepts_reprop(optimizer, machine, capsys, monkeypatch):
    report = fusion_report(optimizer, machine, capsys, monkeypatch)
    assert "bit for bit after 3 steps: ok" in report


# ---------------------------------------------------------------------------
# fad.py
# ---------------------------------------------------------------------------

import fad as fad_bench  # noqa: E402


class NegatedDerivative(torch.autograd.Function):
    """Wrong: f's value, -f'(x) in backward."""

    @staticmethod
    def forward(ctx, x, module):
        ctx.save_for_backward(x)
        ctx.module = module
        return module(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            (dx,) = torch.autograd.grad(ctx.module(x), x, g)
        return -dx, None


def negated(act: str):
    """An activation factory: ``act``'s native module with a sign-flipped derivative."""
    native = fad_bench.models.activation(act, "native")

    class Negated(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.f = native()

        def forward(self, x):
            return NegatedDerivative.apply(x, self.f)

    return Negated


def fad_report(model: str, act: str, names: list[str], machine: dict, capsys, monkeypatch) -> str:
    """fad.py's printed report of the saved-bytes run (which takes the first steps) of a small case."""
    activation = fad_bench.models.activation
    monkeypatch.setattr(fad_bench.models, "activation",
                        lambda a, variant: negated(a) if variant == "negated" else activation(a, variant))
    monkeypatch.setitem(fad_bench.CANDIDATES, "negated", fad_bench.Candidate("negated", "negated"))
    args = SimpleNamespace(device="cpu", batch=2, image_size=32, bert_layers=1, seq_len=16, amp=False,
                           bytes_only=True, reps=1, warmup=0, mem_cap_gib=0)
    result = fad_bench.run_case(fad_bench.Case(model, act), names, CPU, args)
    capsys.readouterr()
    fad_bench.print_report([result], [], [], names, machine, args)
    return capsys.readouterr().out


def test_fad_flags_a_sign_flipped_derivative(machine, capsys, monkeypatch):
    # The old check compared the loss and the global gradient norm within 5%, which a negated
    # derivative keeps here (the loss is the same).
    report = fad_report("bert_base", "gelu_tanh", [fad_bench.NATIVE, "negated"], machine, capsys, monkeypatch)
    assert "WARNING: bert_base gelu_tanh negated: first step" in report


def test_fad_accepts_reprop(machine, capsys, monkeypatch):
    names = [fad_bench.NATIVE, fad_bench.PATCH, fad_bench.PATCH_U8, fad_bench.COMPOSE_BF16]
    report = fad_report("bert_base", "gelu_tanh", names, machine, capsys, monkeypatch)
    assert "for bf16 and u8" in report and report.rstrip().endswith(": ok")


def test_fad_micro_forward_rows_against_native_forward():
    # "x native" divided native's forward + backward time by a forward-only time (2.5 here).
    r = fad_bench.MicroResult("mish", "fp32", 2**10)
    times = {"torch native": 10.0, "reprop": 8.0, "torch native fwd": 4.0, "reprop fwd": 5.0, fad_bench.PROBE: 2.0}
    r.stats = {n: harness.Stats.from_samples([ms]) for n, ms in times.items()}
    x = {row["candidate"]: row["x_native"] for row in fad_bench.micro_rows(r)}
    assert x == {"torch native": 1.0, "torch composed": None, "checkpointed": None, "reprop": 1.25,
                 "reprop u8": None, "reprop compose": None, "torch native fwd": 1.0, "reprop fwd": 0.8,
                 fad_bench.PROBE: 5.0}

MICRO_ARGS = SimpleNamespace(device="cpu", amp=False, warmup=0, micro_reps=1, micro_log2=12)


def micro_report(act: str, dtype: str, machine: dict, capsys) -> tuple[str, list]:
    """fad.py's printed micro report of one activation and dtype on 2^12 elements, and its results."""
    micro = [fad_bench.run_micro(act, dtype, 2**MICRO_ARGS.micro_log2, CPU, MICRO_ARGS)]
    capsys.readouterr()
    fad_bench.print_report([], micro, [], [], machine, MICRO_ARGS)
    return capsys.readouterr().out, micro


def test_fad_micro_flags_a_sign_flipped_derivative(machine, capsys, monkeypatch):
    # The micro grad err column was printed and never checked.
    monkeypatch.setattr(fad_bench, "MICRO_CANDIDATES", (*fad_bench.MICRO_CANDIDATES,
                                                        fad_bench.MicroCandidate("negated", True,
                                                                                 lambda a: negated(a)())))
    out, micro = micro_report("gelu_tanh", "fp32", machine, capsys)
    assert "WARNING: micro gelu_tanh fp32 negated: grad err 2" in out
    assert fad_bench.check_failed([], micro, amp=False)


@pytest.mark.parametrize("act, dtype", [("mish", "fp32"), ("gelu_tanh", "bf16"), ("swish", "bf16")])
def test_fad_micro_accepts_reprop(act, dtype, machine, capsys):
    out, micro = micro_report(act, dtype, machine, capsys)
    assert "max |dx_native|: ok" in out and not fad_bench.check_failed([], micro, amp=False)
    assert {"reprop", "reprop u8", "reprop compose"} <= set(micro[0].grad_err)


# ---------------------------------------------------------------------------
# ooo.py
# ---------------------------------------------------------------------------

import ooo as ooo_bench  # noqa: E402


def ooo_single_report(capsys, monkeypatch, wrong: bool) -> str:
    """ooo.py's printed single-device table on small_net (ooo dropping the first layer's dW if ``wrong``)."""
    enable = ooo_bench.ooo.enable

    def maybe_wrong(model, *args, **kwargs):
        handle = enable(model, *args, **kwargs)
        if wrong:
            model[0].weight.requires_grad_(False)
        return handle

    monkeypatch.setattr(ooo_bench.ooo, "enable", maybe_wrong)
    monkeypatch.setattr(ooo_bench.models, "build", lambda name: small_net())
    args = SimpleNamespace(quick=True, models=[], batches=[8], warmup=1, reps=2)
    rows = ooo_bench.run_single(args, CPU)
    capsys.readouterr()
    ooo_bench.print_single(rows)
    return capsys.readouterr().out


def test_ooo_single_flags_a_missing_weight_gradient(capsys, monkeypatch):
    # The single-device part compared nothing (and ooo took more steps than eager).
    report = ooo_single_report(capsys, monkeypatch, wrong=True)
    assert "parameters and gradients equal to eager's" in report and "NO: ooo:" in report


def test_ooo_single_peaks_leave_captured_steps_out(capsys):
    # A CUDA graph's replay calls no allocator: peak_memory read 0 bytes for graph and ooo+graph,
    # recorded as their peaks, and "extra peak" fell back to ooo over eager unannounced.
    def alloc():
        return torch.empty(1 << 16)

    trainers = {"eager": SimpleNamespace(graph=None, step=alloc), "graph": SimpleNamespace(graph=object(), step=alloc)}
    peaks = ooo_bench.step_peaks(trainers, CPU)
    assert peaks["graph"] is None and peaks["eager"] >= 4 << 16
    row = {"model": "m", "batch": 8, "errors": {}, "steps": 5, "cpu": False, "mismatch": {},
           "images_per_s": {"eager": 1.0, "ooo": 1.0, "graph": 2.0, "ooo+graph": 2.0},
           "peak_bytes": {"eager": 100, "ooo": 110, "graph": None, "ooo+graph": None}}
    ooo_bench.print_single([row])
    out = capsys.readouterr().out
    assert "extra peak (ooo/eager)" in out and "+10.0%" in out


def test_ooo_pipeline_times_and_checks_torchs_gpipe(capsys):
    # The pipeline schedules were compared with reprop's own GPipe alone: torch's
    # torch.distributed.pipelining ScheduleGPipe, the peer in torch, was not run.
    (r,) = ooo_bench.spawn_ranks(2, [(ooo_bench.pipe_job, dict(reps=1, warmup=0))])
    assert ooo_bench.TORCH_GPIPE in r["ms"] and r["grad_mismatch_single"][ooo_bench.TORCH_GPIPE] is None
    ooo_bench.print_dist_pipeline(r)
    out = capsys.readouterr().out
    assert "x torch GPipe" in out and "equal to single-process training's (rtol 1e-05, largest" in out
    assert "): yes; to GPipe's: yes" in out


def test_ooo_single_accepts_ooo(capsys, monkeypatch):
    report = ooo_single_report(capsys, monkeypatch, wrong=False)
    assert "seeded steps (bitwise): yes" in report


def test_peak_memory_on_cpu_counts_what_the_step_starts_with():
    # A step whose first event is a free: the peak is what it started with, setup's 256 KiB, as the
    # CUDA counters give (reset_peak_memory_stats leaves the peak at what is allocated). The
    # profiler's running sum took its peak over the step's events alone: 16 KiB here.
    held = []

    def step():
        held.clear()
        torch.empty(1 << 12).fill_(1)

    assert harness.peak_memory(step, CPU, lambda: held.append(torch.empty(1 << 16))) == 4 << 16
    # A step that allocates nothing peaks at what it holds, not at 0.
    assert harness.peak_memory(lambda: None, CPU, lambda: held.append(torch.empty(1 << 10))) == 4 << 10


# ---------------------------------------------------------------------------
# bppsa.py
# ---------------------------------------------------------------------------

import json  # noqa: E402

import bppsa as bppsa_bench  # noqa: E402

# The vgg part at 1/32 width (2 to 16 channels), unpruned and 90% pruned, the linear scan and one
# up-sweep level, one round: a few seconds.
VGG_TINY = ["--part", "vgg", "--vgg-width-div", "32", "--vgg-sparsities", "0,0.9", "--vgg-levels", "0,1",
            "--reps", "1", "--warmup", "0"]
RNN_TINY = ["--part", "rnn-t", "--seq-lens", "10", "--batch", "2", "--hidden", "4", "--reps", "1", "--warmup", "0"]


def test_bppsa_vgg_part_runs(capsys, tmp_path):
    # It raised a TypeError from nonzero_values since reprop.bppsa's _Leaf.entry_values takes the
    # layer's weight (commit b5dbfe6).
    bppsa_bench.main(VGG_TINY + ["--json", str(tmp_path / "vgg.json")])
    out = capsys.readouterr().out
    assert "per sparsity and schedule" in out and "of autograd's (err, masked err, cusparse err): ok" in out
    rows = json.loads((tmp_path / "vgg.json").read_text())["vgg"]["rows"]
    assert [(r["sparsity"], r["levels"]) for r in rows] == [(0.0, 0), (0.0, 1), (0.9, 0), (0.9, 1)]
    # Inactive ReLUs and unpicked pool entries are zeros at any sparsity; pruning zeroes weights.
    dense, pruned = rows[0]["nonzero_values"], rows[2]["nonzero_values"]
    assert 0 < pruned < dense < rows[0]["nnz"]


def test_bppsa_vgg_part_follows_min_sample_ms(monkeypatch, tmp_path):
    # It timed one call per sample whatever --min-sample-ms said (the RNN parts followed it), so its
    # microsecond-scale CUDA calls were timed at the events' resolution. Each call is timed at 10 ms
    # here: on a loaded machine a real call took over 50 ms, and one call per sample was right.
    monkeypatch.setattr(harness, "time_call", lambda fn, device, inner=1: 10.0)
    bppsa_bench.main(VGG_TINY + ["--vgg-sparsities", "0.9", "--min-sample-ms", "50",
                                 "--json", str(tmp_path / "vgg.json")])
    setting = json.loads((tmp_path / "vgg.json").read_text())["vgg"]["setting"]
    assert setting["calls_per_sample_s0.9"] == 5


def test_bppsa_keeps_a_part_measured_before_a_later_part_fails(capsys, monkeypatch, tmp_path):
    # main() printed and saved nothing until every part had run: the vgg part's crash lost the
    # RNN tables measured before it.
    def broken(args, device):
        raise RuntimeError("the vgg part broke")

    monkeypatch.setattr(bppsa_bench, "run_vgg", broken)
    with pytest.raises(RuntimeError, match="the vgg part broke"):
        bppsa_bench.main(RNN_TINY + ["--part", "vgg", "--json", str(tmp_path / "out.json")])
    assert "\nrnn-t\n" in capsys.readouterr().out
    rows = json.loads((tmp_path / "out.json").read_text())["rows"]
    assert [(r["part"], r["seq_len"], r["batch"], r["hidden"]) for r in rows] == [("rnn-t", 10, 2, 4)]


def test_bppsa_vgg_flags_a_negated_input_gradient(capsys, monkeypatch):
    # The err columns were printed and never checked: a negated dx (err 2) ran through, exit status 0.
    chain_backward = bppsa_bench.reprop_bppsa().chain_backward

    def negated(*args, **kwargs):
        dx, *rest = chain_backward(*args, **kwargs)
        return (-dx, *rest)

    monkeypatch.setattr(bppsa_bench.reprop_bppsa(), "chain_backward", negated)
    with pytest.raises(SystemExit) as exit_:
        bppsa_bench.main(VGG_TINY)
    assert exit_.value.code == 1
    out = capsys.readouterr().out
    assert "WARNING: vgg sparsity 0 chain L0: input gradient error 2" in out
    assert "of autograd's (err, masked err, cusparse err): WARNING, see above" in out


def test_bppsa_flags_a_gradient_off_by_a_thousandth(capsys, monkeypatch):
    # The RNN/GRU grad err was flagged above 1e-2 only, where fp32 gives ~3e-7, and never failed the run.
    make_trainer = bppsa_bench.make_trainer

    def off(cfg, device, scan=None):
        trainer = make_trainer(cfg, device, scan)
        if scan is not None:
            for p in trainer.model.parameters():
                p.register_hook(lambda g: g * (1 + 1e-3))
        return trainer

    monkeypatch.setattr(bppsa_bench, "make_trainer", off)
    with pytest.raises(SystemExit) as exit_:
        bppsa_bench.main(RNN_TINY)
    assert exit_.value.code == 1
    assert "WARNING: T=10 B=2 d=4: gradient error 0.001 vs the baseline" in capsys.readouterr().out

