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


def fake_stats(**ms: float) -> dict[str, harness.Stats]:
    """{name: Stats} of one sample each: the median is the given time (ms); names with spaces as **{...}."""
    return {name.replace("_", " "): harness.Stats.from_samples([t]) for name, t in ms.items()}


# ---------------------------------------------------------------------------
# harness.py: the formulas every figure goes through (fake timings, no timing assertions)
# ---------------------------------------------------------------------------


def test_stats_summarise_every_sample():
    # A median of all samples (none dropped as a warm-up), min, max and the quartiles the right way round.
    s = harness.Stats.from_samples([5.0, 1.0, 4.0, 2.0, 3.0, 9.0])
    assert (s.median, s.min, s.max, s.q1, s.q3) == (3.5, 1.0, 9.0, 2.25, 4.75)
    assert s.iqr == 2.5 and s.samples == [5.0, 1.0, 4.0, 2.0, 3.0, 9.0]


def test_time_call_returns_ms_per_call(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(harness.time, "perf_counter", lambda: clock[0])

    def call():  # 2 ms per call
        clock[0] += 2e-3

    assert harness.time_call(call, CPU, inner=5) == pytest.approx(2.0)


def test_time_call_reads_the_clock_given(monkeypatch):
    # The host sweep times thread CPU time: a clock given replaces perf_counter on the CPU.
    clock = [0.0]
    monkeypatch.setattr(harness.time, "perf_counter", lambda: 0.0)

    def call():  # 3 ms per call on the clock given
        clock[0] += 3e-3

    assert harness.time_call(call, CPU, inner=4, clock=lambda: clock[0]) == pytest.approx(3.0)
    assert harness.measure_alternated({"a": call}, CPU, 0, 2, 1, clock=lambda: clock[0])["a"].median == pytest.approx(3.0)


def test_choose_inner_lets_the_fastest_candidate_reach_the_minimum_sample(monkeypatch):
    times = {"fast": 0.3, "slow": 0.7}
    monkeypatch.setattr(harness, "time_call", lambda fn, device, inner=1: times[fn()])
    fns = [lambda: "fast", lambda: "slow"]
    # 3 calls of the fastest take 0.9 ms < 1 ms: 4 are needed
    assert harness.choose_inner(fns, CPU, min_sample_ms=1.0) == 4
    assert harness.choose_inner(fns, CPU, min_sample_ms=1.0, max_inner=3) == 3
    assert harness.choose_inner(fns, CPU, min_sample_ms=0.0) == 1


def test_measure_alternated_rotates_and_leaves_the_warmups_out():
    calls = []
    candidates = {name: (lambda name=name: calls.append(name)) for name in "ABC"}
    stats = harness.measure_alternated(candidates, CPU, warmup=2, reps=3, inner=2)
    assert calls[:6] == list("AABBCC")  # the warm-ups, untimed
    timed = calls[6:]
    assert timed == [c for c in "AABBCC" "BBCCAA" "CCAABB"]
    assert {n: len(s.samples) for n, s in stats.items()} == {"A": 3, "B": 3, "C": 3}


class FakeCudaAllocator:
    """torch.cuda's allocated-bytes counters, driven by alloc() and free()."""

    def __init__(self, allocated: int):
        self.allocated = self.peak = allocated

    def alloc(self, n: int) -> None:
        self.allocated += n
        self.peak = max(self.peak, self.allocated)

    def free(self, n: int) -> None:
        self.allocated -= n

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                            lambda device=None: setattr(self, "peak", self.allocated))


def test_peak_memory_on_cuda_counts_setups_holdings_not_its_transients(monkeypatch):
    # The measured step's peak, counted from before setup(): what setup still holds (100), plus the
    # step's own transient (50); setup's freed transient (1000) and what was held before (10) not.
    alloc = FakeCudaAllocator(10)
    alloc.install(monkeypatch)

    def setup():
        alloc.alloc(1000)
        alloc.free(1000)
        alloc.alloc(100)

    def step():
        alloc.alloc(50)
        alloc.free(50)

    assert harness.peak_memory(step, torch.device("cuda", 0), setup) == 150


def test_peak_memory_on_cpu_counts_setups_holdings_not_its_transients():
    held = []

    def setup():
        torch.empty(1 << 18).fill_(1)  # a transient of setup's: 1 MiB, freed
        held.append(torch.empty(1 << 10))

    peak = harness.peak_memory(lambda: torch.empty(1 << 12).fill_(1), CPU, setup)
    assert peak == 4 * ((1 << 10) + (1 << 12))


def test_speedup_and_bandwidth_formulas():
    assert harness.speedup(10.0, 4.0) == 2.5  # peer / ours: > 1, ours faster
    assert harness.gbps(3e9, 1500.0) == pytest.approx(2.0)  # 3 GB in 1.5 s


@pytest.mark.parametrize("kind, bytes_per_element", [("copy", 8), ("inplace", 12)])
def test_bandwidth_probes_move_the_bytes_asked(kind, bytes_per_element):
    out = harness.make_bandwidth_probe(96_000, CPU, kind)()  # copy_ and add_ return the written tensor
    assert out.numel() * bytes_per_element == 96_000 and out.dtype == torch.float32


def test_error_checks():
    assert harness.within(None, 0.0) and harness.within(1e-5, 1e-5) and not harness.within(2e-5, 1e-5)
    assert not harness.within(float("nan"), 1.0)
    # In units of the reference's largest magnitude, not the candidate's.
    assert harness.relative_error(torch.tensor([0.0, 3.0]), torch.tensor([0.0, 2.0])) == 0.5
    assert harness.relative_error(torch.tensor([float("nan")]), torch.tensor([1.0])) == float("inf")
    want = {"a": torch.tensor([1.0]), "b": torch.tensor([10.0])}
    assert harness.check_close({"a": torch.tensor([1.5]), "b": torch.tensor([10.0])}, want, 0.0,
                               {"a": 0.1, "b": 1.0}) is not None  # a's own tolerance, not b's
    assert harness.check_close({"a": torch.tensor([1.05]), "b": torch.tensor([10.5])}, want, 0.0,
                               {"a": 0.1, "b": 1.0}) is None
    assert "different tensors" in harness.check_close({**want, "c": torch.tensor([0.0])}, want, 0.0, 0.0)


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


@pytest.mark.parametrize("name", list(optim_bench.OPTIMIZERS))
def test_optim_traffic_counts_the_tensors_it_names(name):
    # bytes/param, every GB/s figure's numerator: 4 bytes per tensor read or written, as printed.
    spec = optim_bench.OPTIMIZERS[name]
    reads, writes = (part.split()[1].split(",") for part in spec.traffic.split(" = ")[0].split(" + "))
    assert spec.bytes_per_param == 4 * (len(reads) + len(writes))


def test_optim_table_ratios():
    # speedup = peer / reprop; reprop's GB/s over the step's bytes; "% copy" = reprop's bandwidth over the
    # probe's = probe ms / reprop ms.
    result = optim_bench.CaseResult("adamw", optim_bench.ParamSet("single", "1x1M", [torch.Size([10**6])]),
                                    bytes_per_step=28 * 10**6, inner=1)
    result.stats = fake_stats(**{optim_bench.FOREACH: 6.0, optim_bench.FUSED: 4.0, optim_bench.REPROP: 2.0,
                                 "copy": 1.0, "inplace": 1.5})
    rows = {r["peer"]: r for r in optim_bench.table_rows(result)}
    assert (rows[optim_bench.FOREACH]["speedup"], rows[optim_bench.FUSED]["speedup"]) == (3.0, 2.0)
    row = rows[optim_bench.FUSED]
    assert row["reprop_gbps"] == pytest.approx(14.0) and row["peer_gbps"] == pytest.approx(7.0)
    assert (row["reprop_copy_fraction"], row["reprop_inplace_fraction"]) == (0.5, 0.75)


def test_optim_compare_updates_rule():
    # SGD is torch's bit for bit on the CPU; on CUDA torch's kernels are other code: a rounding step passes.
    want = {"p": torch.tensor([1.0, 2.0])}
    got = {"p": torch.nextafter(want["p"], torch.tensor(3.0))}
    init = {"p": torch.tensor([1.5, 2.5])}
    spec = optim_bench.OPTIMIZERS["sgd"]
    assert optim_bench.compare_updates(spec, got, want, init, CPU) is not None
    assert optim_bench.compare_updates(spec, got, want, init, torch.device("cuda")) is None
    # Elsewhere within CHECK_ULPS rounding steps of the element and of the tensor's largest *update*,
    # not of its largest value: a small element's update 1% off beside a large element is flagged.
    want, init = {"p": torch.tensor([100.0, 1e-3])}, {"p": torch.tensor([100.001, 0.0])}
    got = {"p": torch.tensor([100.0, 1.01e-3])}
    assert optim_bench.compare_updates(optim_bench.OPTIMIZERS["adamw"], got, want, init, CPU) is not None
    assert optim_bench.compare_updates(optim_bench.OPTIMIZERS["adamw"], want, want, init, CPU) is None


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


def test_fusion_rows_and_summary_formulas():
    # x <baseline> = baseline ms / candidate ms; opt share = (foreach - floor) / foreach; saved ms =
    # foreach - fusion; best torch = the fastest of torch's three; peak saving = (eager - BF) / grads.
    F = fusion_bench
    result = F.CaseResult(F.Case("mobilenet_v2", 8, "adamw"), ["optims"], num_tensors=2, num_params=2**20)
    result.stats = fake_stats(**{F.FOREACH: 10.0, F.FUSED: 8.0, F.TORCH_BACKWARD: 9.0, F.EAGER: 7.0,
                                 F.FORWARD: 6.0, F.BACKWARD: 5.0, F.FLOOR: 4.0})
    result.peak_bytes = {F.EAGER: 10 * F.MIB, F.BACKWARD: 8 * F.MIB}
    rows = {r["candidate"]: r for r in F.detail_rows(result, F.candidate_names(False))}
    assert rows[F.BACKWARD]["x_" + F.FOREACH] == 2.0 and rows[F.BACKWARD]["x_" + F.EAGER] == 1.4
    assert rows[F.BACKWARD]["peak_vs_eager_mib"] == -2.0
    summary = F.summary_row(result)
    assert summary["opt_share_foreach"] == 0.6 and summary["opt_share_eager"] == pytest.approx(3 / 7)
    assert (summary["bf_x_foreach"], summary["bf_x_best_torch"], summary["bf_x_torch_backward"]) == (2.0, 1.6, 1.8)
    assert (summary["ff_saved_ms"], summary["bf_saved_ms"]) == (4.0, 5.0)
    assert summary["bf_peak_saving_of_grads"] == 0.5  # 2 MiB of 4 MiB of gradients
    assert summary["params_per_tensor"] == 2**19


def test_fusion_times_with_the_warmups_and_rounds_asked(monkeypatch):
    seen = []
    monkeypatch.setattr(harness, "measure_alternated",
                        lambda candidates, device, warmup, reps, inner=1: seen.append((warmup, reps)) or {})
    result = fusion_bench.CaseResult(fusion_bench.Case("mobilenet_v2", 2, "sgd"), ["optims"], 0, 0)
    fusion_bench.time_candidates(result, torch.nn.Linear(3, 2), (torch.randn(2, 3), torch.tensor([0, 1])), {},
                                 [fusion_bench.FLOOR], CPU, SimpleNamespace(warmup=2, reps=7))
    assert seen == [(2, 7)]


# ---------------------------------------------------------------------------
# fusion.py --sweeps host
# ---------------------------------------------------------------------------


def fusion_host_report(capsys, monkeypatch) -> str:
    monkeypatch.setattr(sys, "argv", ["fusion.py", "--sweeps", "host", "--layers", "3", "--reps", "2",
                                      "--inner", "1"])
    fusion_bench.main()
    return capsys.readouterr().out


def test_fusion_host_times_every_candidate_and_checks_the_fusions(capsys, monkeypatch):
    report = fusion_host_report(capsys, monkeypatch)
    for name in ("floor", "torch hooks", "torch foreach", "torch fused", "torch backward",
                 "reprop eager", "reprop forward", "reprop backward"):
        assert f"\n{name} " in report
    assert "equal their eager candidate bit for bit: ok" in report


def test_fusion_host_flags_a_fusion_that_updates_nothing(capsys, monkeypatch):
    import reprop.fusion
    monkeypatch.setattr(reprop.fusion._BackwardFusion, "_step_params", lambda self, params, settings: None)
    with pytest.raises(SystemExit) as exit:
        fusion_host_report(capsys, monkeypatch)
    assert exit.value.code == 1
    report = capsys.readouterr().out
    assert "WARNING: reprop backward: 0.weight differs from reprop eager's" in report
    assert "WARNING: reprop forward" not in report


def test_fusion_default_sweeps_leave_out_the_cpu_only_host_sweep(monkeypatch):
    # gpu_session.sh runs fusion.py --device cuda with the default sweeps: host would refuse CUDA.
    monkeypatch.setattr(sys, "argv", ["fusion.py"])
    assert fusion_bench.parse_args().sweeps == ["models", "batches", "optims"]
    monkeypatch.setattr(sys, "argv", ["fusion.py", "--device", "cuda", "--sweeps", "host"])
    with pytest.raises(SystemExit) as exit_:
        fusion_bench.parse_args()
    assert exit_.value.code == 2


def test_fusion_host_pairs_rounds(capsys):
    # differences 2, -1, 3 us (median 2, over 2 tensors 1.00); ratios 1.25, 0.952, 1.111 (median 1.111)
    samples = {"reprop forward": [10.0, 20.0, 30.0], "old forward": [8.0, 21.0, 27.0]}
    fusion_bench.print_paired(samples, "old", tensors=2)
    assert capsys.readouterr().out == ("reprop forward - old forward: +2 us/step, +1.00 us/tensor "
                                       "(median of paired rounds); ratio 1.111\n")


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


def test_fad_micro_counts_the_bytes_each_candidate_moves():
    # fp32 (4 B): native 2 forward + 3 backward elements; reprop 3 + 3 (d in fp32), with u8 codes 2 + 2
    # elements and 1 + 1 bytes; the probe copies reprop's forward + backward traffic.
    n = 2**10
    r = fad_bench.run_micro("swish", "fp32", n, CPU, SimpleNamespace(warmup=0, micro_reps=1))
    assert r.nbytes == {"torch native": 20 * n, "reprop": 24 * n, "reprop u8": 18 * n, "reprop compose": 24 * n,
                        "torch native fwd": 8 * n, "reprop fwd": 12 * n, fad_bench.PROBE: 24 * n}


def test_fad_micro_tolerance_scales_the_codebook_error():
    # f' off by the codebook's max error e puts dx off by e |g|: in units of max |dx_native|, e max|g| / max|dx|.
    u8 = next(c for c in fad_bench.MICRO_CANDIDATES if c.name == "reprop u8")
    e = fad_bench.codebook_error("swish")
    tolerance = fad_bench.micro_tolerance(u8, "swish", "fp32", torch.tensor([10.0, -1.0]), torch.tensor([0.5, 2.0]))
    assert tolerance == pytest.approx(fad_bench.MICRO_TOLERANCE["fp32"] + 5 * e)


def test_fad_step_rows_against_native_and_the_identity_model():
    # act = saved - the Identity model's saved, per call for tensors and per input byte for x.
    r = fad_bench.CaseResult(fad_bench.Case("resnet50", "mish"), 2, fad_bench.ActivationCalls(4, 1000),
                             identity=fad_bench.Saved(5000, 10))
    r.saved = {fad_bench.NATIVE: fad_bench.Saved(6000, 14), fad_bench.COMPOSED: fad_bench.Saved(8000, 22)}
    r.stats = fake_stats(**{fad_bench.NATIVE: 10.0, fad_bench.COMPOSED: 12.5, fad_bench.CHECKPOINTED: 20.0})
    r.peak_bytes = {fad_bench.NATIVE: 100, fad_bench.COMPOSED: 150}
    row = {x["candidate"]: x for x in fad_bench.step_rows(r, [fad_bench.NATIVE, fad_bench.COMPOSED])}[
        fad_bench.COMPOSED]
    assert (row["x_native"], row["x_ckpt"]) == (0.8, 1.6)
    assert (row["act_x"], row["act_tensors"], row["saved_vs_native"], row["peak_vs_native"]) == (3.0, 3.0, 4 / 3, 1.5)


def test_fad_largest_batch_bisects_to_the_last_that_fits(monkeypatch):
    # Doubling to 16, then bisection between 16 and 32: 23 fits, 24 does not.
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1000)
    monkeypatch.setattr(harness, "release", lambda device: None)
    monkeypatch.setattr(fad_bench, "make_trainer", lambda *a, **k: None)
    monkeypatch.setattr(fad_bench, "batch_peak", lambda trainer, case, b, device, args: 1000 + 10 * b)
    assert fad_bench.largest_batch(None, None, 230, torch.device("cuda"), None) == 23
    assert fad_bench.largest_batch(None, None, 5, torch.device("cuda"), None) == 0


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
           "peak_bytes": {"eager": 100, "ooo": 110, "graph": None, "ooo+graph": None},
           "schedule": {"moved": 3, "regions": 8, "cap_base": "peak", "held_bytes": [0, 2**20, 0],
                        "base_peak_bytes": 10 * 2**20}}
    ooo_bench.print_single([row])
    out = capsys.readouterr().out
    assert "extra peak (ooo/eager)" in out and "+10.0%" in out
    assert ("m b8: 3 dW moved over 8 regions, cap base peak, most held at a region end 1.0 MiB "
            "(10.0% of P = 10.0 MiB)") in out


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


def test_ooo_throughput_and_ratio_formulas(monkeypatch):
    # images/s = batch / (median ms / 1000); x <baseline> = baseline ms / candidate ms; the split's cost
    # per layer in microseconds.
    monkeypatch.setattr(ooo_bench.models, "build", lambda name: small_net())
    monkeypatch.setattr(ooo_bench, "settle", lambda trainers: None)  # steps not needed here
    monkeypatch.setattr(ooo_bench, "step_peaks", lambda trainers, device: {})
    monkeypatch.setattr(harness, "measure_alternated", lambda candidates, *a, **k: fake_stats(**{
        n: {"eager": 40.0, "ooo": 50.0, "split": 60.0}[n] for n in candidates}))
    (row,) = ooo_bench.run_single(SimpleNamespace(quick=True, models=[], batches=[8], warmup=0, reps=1), CPU)
    assert row["images_per_s"] == {"eager": 200.0, "ooo": 160.0}
    monkeypatch.setattr(ooo_bench, "SPLIT_CHAINS",
                        {"Linear(4, 4)": (lambda: [torch.nn.Linear(4, 4) for _ in range(8)], (2, 4))})
    (row,) = ooo_bench.run_split(SimpleNamespace(warmup=0, reps=1), CPU)
    assert (row["layers"], row["us_per_layer"], row["split_cost_us"], row["ratio"]) == \
        (8, {"eager": 5000.0, "split": 7500.0}, 2500.0, 40 / 60)
    summary = ooo_bench.stats_summary(fake_stats(DDP=10.0, fast=5.0), "DDP")
    assert summary["speedup"] == {"fast": 2.0} and summary["ms"] == {"DDP": 10.0, "fast": 5.0}


def test_ooo_simulation_formulas():
    # One node: no inter-node ring, whatever its bandwidth. The calibrated bandwidth gives the target
    # all-reduce time. The speedups are the baselines' periods over reverse first-k's.
    sizes = [4_000_000, 1_000_000, 40_000]
    assert ooo_bench.hierarchical_sync(sizes, 4, 1e6) == ooo_bench.hierarchical_sync(sizes, 4, 1e12)
    bw = ooo_bench.calibrated_bandwidth(sizes, 16, 0.2)
    assert sum(ooo_bench.hierarchical_sync(sizes, 16, bw)) == pytest.approx(0.2)
    row = ooo_bench.simulate_dp_case([0.01, 0.02, 0.03], [0.05, 0.01, 0.02])
    assert row["speedup_over_priority"] == pytest.approx(row["priority_ms"] / row["reverse_first_k_ms"])
    assert row["speedup_over_fifo"] == pytest.approx(row["fifo_ms"] / row["reverse_first_k_ms"])
    assert row["allreduce_ms"] == pytest.approx(80.0)


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
    monkeypatch.setattr(harness, "time_call", lambda fn, device, inner=1, clock=None: 10.0)
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



def bppsa_row(fwd: float, fwd_ours: float, base: float, ours: float) -> dict:
    res = bppsa_bench.Result(bppsa_bench.rnn_config(100, 4, 8))
    res.stats = fake_stats(**{bppsa_bench.FWD: fwd, bppsa_bench.FWD_OURS: fwd_ours, bppsa_bench.BASE: base,
                              bppsa_bench.OURS: ours})
    return bppsa_bench.result_row("rnn-t", res)


def test_bppsa_speedups_subtract_the_forward():
    # The paper's backward speedup (base - fwd) / (bppsa - fwd), bppsa's own forward subtracted where it
    # is the faster one; the excluding-overhead one subtracts bppsa's forward; end to end base / bppsa.
    row = bppsa_row(fwd=2.0, fwd_ours=1.0, base=10.0, ours=4.0)
    assert row["bwd_speedup"] == pytest.approx(8 / 3) and row["bwd_speedup_baseline_fwd"] == pytest.approx(4.0)
    assert row["bwd_speedup_excl_overhead"] == pytest.approx(8 / 3) and row["e2e_speedup"] == pytest.approx(2.5)
    row = bppsa_row(fwd=2.0, fwd_ours=3.0, base=10.0, ours=4.0)
    assert row["bwd_speedup"] == pytest.approx(4.0) and row["bwd_speedup_excl_overhead"] == pytest.approx(8.0)
    assert bppsa_row(fwd=2.0, fwd_ours=2.0, base=10.0, ours=2.0)["bwd_speedup"] is None  # within noise


def test_bppsa_paper_speedups_from_its_v100_tables():
    # Appendix G's Tables 4-6 (seconds per epoch), typed here from the paper: T = 1000, B = 16 is
    # FP 25.86, baseline 53.33, BPPSA 29.29; B = 2 is 200.65, 409.33, 227.13; the GRU's S set at
    # B = 16 is FP 1.66, baseline 3.71, FP + overhead 2.1, BPPSA 2.94.
    rnn = bppsa_bench.paper_speedups(bppsa_bench.rnn_config(1000, 16, 20))
    assert rnn["bwd"] == pytest.approx((53.33 - 25.86) / (29.29 - 25.86)) and rnn["bwd_ex"] is None
    assert rnn["e2e"] == pytest.approx(53.33 / 29.29)
    assert bppsa_bench.paper_speedups(bppsa_bench.rnn_config(1000, 2, 20))["e2e"] == pytest.approx(409.33 / 227.13)
    gru = bppsa_bench.paper_speedups(bppsa_bench.gru_config("S", 16))
    assert gru["bwd_ex"] == pytest.approx((3.71 - 1.66) / (2.94 - 2.1))
    assert gru["bwd"] == pytest.approx((3.71 - 1.66) / (2.94 - 1.66)) and gru["e2e"] == pytest.approx(3.71 / 2.94)
    assert bppsa_bench.paper_speedups(bppsa_bench.rnn_config(1000, 16, 32)) == {"bwd": None, "bwd_ex": None,
                                                                               "e2e": None}


def test_bppsa_gradient_error_is_the_worst_parameter():
    base = {"a": torch.ones(3), "b": torch.ones(3)}
    assert bppsa_bench.gradient_error(base, {"a": torch.ones(3), "b": torch.full((3,), 1.5)}) == 0.5
    assert bppsa_bench.gradient_error(base, {"a": torch.ones(3)}) == float("inf")
    a, b = (bppsa_bench.build_model(bppsa_bench.rnn_config(10, 2, 4)) for _ in range(2))
    assert bppsa_bench.same_weights(a, b)
    with torch.no_grad():
        b.head.bias[0] += 1
    assert not bppsa_bench.same_weights(a, b)


def test_bppsa_data_follow_the_paper():
    # Bitstream (Eq. 8): (T, B, 1) bits, labels c in 0..9, x_t ~ Bernoulli(0.05 + 0.1 c); per class
    # the rate within 5 binomial standard deviations. MFCC sets (Table 3): F x C, 11 classes.
    x, y = bppsa_bench.make_data(bppsa_bench.rnn_config(500, 400, 20), CPU)
    assert x.shape == (500, 400, 1) and y.shape == (400,) and set(x.unique().tolist()) <= {0.0, 1.0}
    assert set(y.tolist()) == set(range(10))
    for c in range(10):
        bits = x[:, y == c].flatten()
        p = 0.05 + 0.1 * c
        assert abs(float(bits.mean()) - p) <= 5 * (p * (1 - p) / bits.numel()) ** 0.5
    assert bppsa_bench.models.MFCC_SHAPES == {"S": (259, 38), "M": (517, 24), "L": (1034, 12)}
    x, y = bppsa_bench.make_data(bppsa_bench.gru_config("L", 1000), CPU)
    assert x.shape == (1034, 1000, 12) and set(y.tolist()) == set(range(11))
    assert abs(float(x.mean())) < 0.01 and abs(float(x.std()) - 1) < 0.01


def test_bppsa_models_are_the_papers():
    # Section 4.1, Eq. 9: tanh RNN(1, 20) + Linear(20, 10); Section 4.2, Eq. 10: GRU(C, 20) + Linear(20, 11).
    rnn = bppsa_bench.build_model(bppsa_bench.rnn_config(10, 2, 20))
    assert type(rnn.rnn) is torch.nn.RNN and rnn.rnn.nonlinearity == "tanh"
    assert bppsa_bench.models.param_counts(rnn) == (6, 670)
    gru = bppsa_bench.build_model(bppsa_bench.gru_config("S", 16))
    assert type(gru.rnn) is torch.nn.GRU and bppsa_bench.models.param_counts(gru) == (6, 3831)


def test_bppsa_vgg11_chain_and_dense_ops():
    # Configuration A (VGG-11): 8 convs (64, 128, 256, 256, 512 x 4), 3 Linear (CIFAR classifier).
    layers = bppsa_bench.vgg11_chain(1, 32, classifier=True)
    convs = [m.out_channels for m in layers if isinstance(m, torch.nn.Conv2d)]
    assert convs == [64, 128, 256, 256, 512, 512, 512, 512]
    assert [(m.in_features, m.out_features) for m in layers if isinstance(m, torch.nn.Linear)] == \
        [(512, 512), (512, 512), (512, 10)]
    # Conv 3 -> 4 on 8x8 (pad 1): 3 * 4 * 9 * 64 MACs, ReLU 256 and pool 64 element ops, Linear 64 x 10.
    chain = [torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2, 2), torch.nn.Flatten(),
             torch.nn.Linear(64, 10)]
    assert bppsa_bench.dense_backward_ops(chain, (3, 8, 8)) == (3 * 4 * 9 * 64 + 640, 256 + 64)


def test_bppsa_vgg_rows_speedups(monkeypatch, tmp_path):
    # The vgg rows' ratios from the medians: chain x = autograd / chain, bwd x = (autograd - fwd) / (chain - fwd).
    times = {bppsa_bench.V_FWD: 1.0, bppsa_bench.V_AUTOGRAD: 5.0, "chain L0": 3.0, "masked L0": 2.0}
    monkeypatch.setattr(harness, "measure_alternated", lambda candidates, *a, **k: fake_stats(**{
        n: times.get(n, 4.0) for n in candidates}))
    bppsa_bench.main(VGG_TINY + ["--vgg-sparsities", "0.9", "--vgg-levels", "0", "--vgg-width-div", "64",
                                 "--vgg-features-only", "--json", str(tmp_path / "v.json")])
    (row,) = json.loads((tmp_path / "v.json").read_text())["vgg"]["rows"]
    assert (row["chain_speedup"], row["chain_bwd_speedup"]) == (pytest.approx(5 / 3), pytest.approx(2.0))
    assert (row["masked_speedup"], row["masked_bwd_speedup"]) == (pytest.approx(2.5), pytest.approx(4.0))


# ---------------------------------------------------------------------------
# models.py: the architectures the papers name
# ---------------------------------------------------------------------------

models = bppsa_bench.models

# Parameter counts published for these architectures: torchvision's model pages (num_params) and
# HuggingFace's bert-base-uncased (109,482,240 with the pooler) plus a 768 x 2 + 2 classifier.
PUBLISHED_PARAMS = {"mobilenet_v2": 3_504_872, "mobilenet_v3_large": 5_483_032, "resnet18": 11_689_512,
                    "resnet50": 25_557_032, "densenet121": 7_978_856, "vgg19_bn": 143_678_248,
                    "bert_base": 109_482_240 + 1_538}


def densenet121_params(growth: int) -> int:
    """DenseNet-121's parameters at ``growth``, summed by hand from Huang et al.'s Table 1 (blocks 6, 12,
    24, 16; 64 initial features, 4 x growth bottlenecks, compression 0.5) with torchvision's layers."""
    n = 3 * 64 * 49 + 2 * 64  # conv0, norm0
    ch = 64
    for i, layers in enumerate((6, 12, 24, 16)):
        for _ in range(layers):  # norm1, conv1 1x1, norm2, conv2 3x3
            n += 2 * ch + ch * 4 * growth + 2 * 4 * growth + 4 * growth * growth * 9
            ch += growth
        if i < 3:  # transition: norm, 1x1 conv halving the channels
            n += 2 * ch + ch * (ch // 2)
            ch //= 2
    return n + 2 * ch + ch * 1000 + 1000  # norm5, classifier


@pytest.mark.parametrize("name", sorted(models.MODELS))
def test_models_have_the_published_parameter_counts(name):
    with torch.device("meta"):  # shapes only: no memory, no init cost
        got = models.param_counts(models.build(name))
    spec = models.MODELS[name]
    assert got == (spec.num_tensors, spec.num_params)
    if name in PUBLISHED_PARAMS:
        assert got[1] == PUBLISHED_PARAMS[name]
    if name.startswith("densenet121"):
        assert got == (364, densenet121_params(int(name.partition("_k")[2] or 32)))


def test_models_follow_torchvision_where_counts_cannot_tell():
    # ResNet v1.5: a stage's stride on the 3x3 conv, not the first 1x1; DenseNet: a ReLU after norm5
    # (the classifier sees non-negative features); the activation forms agree with torch's modules.
    with torch.device("meta"):
        r50 = models.resnet50()
    assert (r50.layer2[0].conv1.stride, r50.layer2[0].conv2.stride) == ((1, 1), (2, 2))
    torch.manual_seed(0)
    net = models.DenseNet(growth=4, block_config=(1, 1, 1, 1), num_init_features=8, num_classes=5)
    seen = []
    net.classifier.register_forward_pre_hook(lambda m, inp: seen.append(inp[0]))
    with torch.no_grad():
        net(torch.randn(2, 3, 32, 32))
    assert float(seen[0].min()) >= 0 and float(seen[0].max()) > 0
    models.check_activations()


# ---------------------------------------------------------------------------
# gpu_session.sh / gpu_session.py: the first GPU session's plan (dry run only here)
# ---------------------------------------------------------------------------

import os  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402

import gpu_session  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SESSION_PARTS = ("bench-a", "bench-b", "bench-c")
DEVICE_CALL_LIMIT_S = 540  # a device command's 10 minutes, less a minute for start-up and transfers
DEVICE_FILES_LIMIT = 8     # files a device call brings back from $OUT

needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def gpu_session_dry_run(*args: str) -> list[list[str]]:
    """gpu_session.sh --dry-run's lines, split at tabs: [part, estimate, timeout, command] and
    [\"total\", part, estimate with the build, budget]."""
    out = subprocess.run(["bash", "benchmarks/gpu_session.sh", "--dry-run", *args], cwd=ROOT,
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return [line.split("\t") for line in out.splitlines()]


def normalized(command: str) -> str:
    """A command as RESULTS.md and the script both can write it: python3, one space, no comment."""
    command = command.split("  #", 1)[0].removesuffix("&& \\").strip()
    return re.sub(r"^python ", "python3 ", re.sub(r"\s+", " ", command))


def results_cuda_commands() -> set[str]:
    """Every `--device cuda` command in RESULTS.md, in fenced blocks or inline code."""
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    blocks = re.findall(r"^```\n(.*?)^```", text, flags=re.S | re.M)
    lines = [line for block in blocks for line in block.splitlines()]
    lines += re.findall(r"`([^`\n]+)`", re.sub(r"^```\n.*?^```", "", text, flags=re.S | re.M))
    return {normalized(line) for line in lines if "--device cuda" in line}


@needs_bash
def test_gpu_session_runs_every_cuda_command_results_names_and_no_other():
    lines = gpu_session_dry_run(*SESSION_PARTS)
    planned = {normalized(cmd) for part, _, _, cmd in lines if part in SESSION_PARTS}
    named = results_cuda_commands()
    assert len(named) >= 9  # optim, fusion, 3 x fad, 2 x bppsa, 2 x ooo: the parser still finds them
    assert named - planned == set(), "RESULTS.md names CUDA commands the session would not run"
    assert planned - named == set(), "the session runs CUDA commands RESULTS.md does not name"


@needs_bash
def test_gpu_session_parts_fit_a_device_call_issue_targets_first():
    lines = gpu_session_dry_run("build", "tests", *SESSION_PARTS)
    assert [line[0] for line in lines[:2]] == ["build", "tests"]
    totals = {line[1]: (int(line[2]), int(line[3])) for line in lines if line[0] == "total"}
    assert set(totals) == set(SESSION_PARTS)
    for part, (estimate, budget) in totals.items():
        commands = [line for line in lines if line[0] == part]
        assert estimate == int(lines[0][1]) + sum(int(est) for _, est, _, _ in commands)
        assert estimate <= budget <= DEVICE_CALL_LIMIT_S, part
        assert all(int(limit) >= int(est) for _, est, limit, _ in commands)
        outputs = [re.search(r"--json \$OUT/(\S+)", cmd).group(1) for *_, cmd in commands]
        assert len(set(outputs)) == len(outputs)
        assert len(outputs) + 2 <= DEVICE_FILES_LIMIT, part  # + the part's log and build.log
    first = [cmd for part, _, _, cmd in lines if part == "bench-a"][:2]
    assert "bppsa.py" in first[0] and "--part rnn-t" in first[0]  # issue 5: T=1000, B=16, d=20
    assert "--models densenet121_k12 --batches 32" in first[1]     # issue 6
    every = " ".join(cmd for part, _, _, cmd in lines if part in SESSION_PARTS)
    for script in ("optim", "fusion", "fad", "bppsa", "ooo"):
        assert f"benchmarks/{script}.py --device cuda" in every


@needs_bash
def test_gpu_session_commands_parse_with_their_scripts(monkeypatch):
    # An option renamed in a script must not cost the GPU session a command (ooo parses in main()).
    scripts = {"optim": optim_bench, "fusion": fusion_bench, "fad": fad_bench, "bppsa": bppsa_bench}
    parsed = 0
    commands = [cmd for part, _, _, cmd in gpu_session_dry_run(*SESSION_PARTS) if part in SESSION_PARTS]
    for cmd in commands:
        argv = cmd.replace("$OUT", "/tmp").split()[1:]
        script = scripts.get(Path(argv[0]).stem)
        if script is not None:
            monkeypatch.setattr(sys, "argv", argv)
            args = script.parse_args(argv[1:]) if script is bppsa_bench else script.parse_args()
            assert args.device == "cuda" and args.json.startswith("/tmp/")
            parsed += 1
    assert parsed == 8


@needs_bash
@pytest.mark.parametrize("budget_s", [40, 60])
def test_gpu_session_time_guard_shortens_timeouts_then_skips(tmp_path, budget_s):
    # PYTHON=echo: each command only prints itself, so the run shows the guard's arithmetic:
    # a command gets the time left less 15 s, and none starts with under 30 s left.
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": "echo", "GPU_SESSION_BUDGET_S": str(budget_s)}
    subprocess.run(["bash", "benchmarks/gpu_session.sh", "--device", "cpu", "--quick", "bench-c"], cwd=ROOT,
                   env=env, capture_output=True, text=True, check=True, timeout=60)
    log = (tmp_path / "bench-c.log").read_text()
    commands = [cmd for part, _, _, cmd in gpu_session_dry_run("--device", "cpu", "--quick", "bench-c")
                if part == "bench-c"]
    if budget_s == 40:
        assert log.count("SKIPPED (time guard") == len(commands) and "run [" not in log
    else:
        limits = [int(t) for t in re.findall(r"run \[estimate \d+ s, timeout (\d+) s", log)]
        assert len(limits) == len(commands) and all(40 <= t <= 45 for t in limits), log
        assert "benchmarks/ooo.py --device cpu --quick" in log  # echo's output went to the log


@needs_bash
def test_gpu_session_smoke_run_swaps_every_cuda_option():
    for part, _, _, cmd in gpu_session_dry_run("--device", "cpu", "--quick", *SESSION_PARTS):
        if part in SESSION_PARTS:
            assert "--device cpu --quick" in cmd and "cuda" not in cmd and "--reps" not in cmd, cmd


def test_gpu_session_collector_writes_results_rows(tmp_path, machine, capsys):
    payload = {"benchmark": "optim", "machine": machine,
               "rows": [{"optimizer": "AdamW", "case": "1x100M", "ms": {"reprop": 0.81, "peer": 1.2}},
                        {"optimizer": "SGD", "case": "a|b", "extra": 3}],
               "targets": [{"target": "speedup >= 1", "ok": True}],
               "simulate_dp": {"compute_ms": 9.5, "rows": [{"gpus": 16, "speedup": 1.5}]},
               "cases": [{"stats_ms": {"samples": [1.0, 2.0]}}]}
    (tmp_path / "optim-cuda.json").write_text(json.dumps(payload))
    (tmp_path / "optim-z.json").write_text(json.dumps({"machine": {**machine, "device": "cuda", "git_commit": None}}))
    command = "python3 benchmarks/optim.py --device cuda --json $OUT/optim-cuda.json"
    (tmp_path / "bench-a.log").write_text(
        f"noise\ngpu_session: run [estimate 45 s, timeout 180 s, at 3 s]: {command}\nmore\n")
    gpu_session.main([str(tmp_path), "--commit", "abc123"])
    out = capsys.readouterr().out
    assert f"`{command}`" in out
    assert f"### CPU ({machine['date'][:10]}, commit {machine['git_commit'] or 'abc123'})" in out
    assert harness.describe_machine(machine).splitlines()[0] in out
    assert out.index("<!-- optim-cuda.json -->") < out.index(
        f"<!-- optim-z.json -->\n### CUDA ({machine['date'][:10]}, commit abc123)")
    assert "`command not found in the logs`" in out
    assert ("| optimizer | case | ms.reprop | ms.peer | extra |\n| --- | --- | --- | --- | --- |\n"
            "| AdamW | 1x100M | 0.81 | 1.2 | - |\n| SGD | a\\|b | - | - | 3 |") in out
    assert "| target | ok |\n| --- | --- |\n| speedup >= 1 | True |" in out
    assert "simulate_dp:\n\n| gpus | speedup |\n| --- | --- |\n| 16 | 1.5 |" in out
    assert "samples" not in out  # the per-sample statistics stay in the JSON
