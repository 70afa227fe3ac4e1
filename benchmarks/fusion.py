"""Benchmark reprop's optimizer fusion (reprop.fuse) against eager training steps.

One training step is the user's unchanged loop, on synthetic data generated once
(random images or token ids, random labels; models.make_batch):

    loss = cross_entropy(model(x), y); loss.backward(); optimizer.step(); optimizer.zero_grad()

Candidates, each training its own copy of the same initial model, all timed in
the same run, alternated (harness.measure_alternated), medians:

    torch foreach    torch.optim.X(foreach=True), eager
    torch fused      torch.optim.X(fused=True), eager (n/a where torch has no fused X there)
    torch backward   torch's own optimizer-in-backward recipe: one torch.optim.X per parameter
                     (fused where torch has it, else foreach), stepped and its gradient freed in
                     the parameter's post-accumulate-grad hook: backward-fusion's torch peer
    reprop eager     reprop.optim.X, eager
    reprop forward   reprop.fuse(model, reprop.optim.X(...), mode="forward"): each update is
                     applied right before its module's next forward (Algorithm 2)
    reprop backward  reprop.fuse(..., mode="backward"): each parameter is updated inside
                     backward() once its gradient is complete, and the gradient freed (Algorithm 3)
    no optimizer     forward + backward + zero_grad, no update: the floor no fusion can beat;
                     (baseline - floor) / baseline is the optimizer's share of a step

Sweeps, after Jiang et al., "Optimizer Fusion" (Figures 4-7, Table 2):

    models   --models at batch --batch (32), AdamW          (Figure 6)
    batches  MobileNetV2 at each of --batches, AdamW        (Figures 4, 5; Table 2 at 32)
    optims   MobileNetV2 at batch --batch, each of --optims (Figure 7)
    host     the hook modes' host cost per parameter tensor (CPU only; run only when named)

A case in several sweeps is measured once. Optimizers and hyper-parameters are
optim.py's (lr 1e-6, so hundreds of steps keep the model in range; AdamW has
weight decay 0.01, the others none); images are 224x224 (--image-size),
token sequences 128 long.

Peak memory, per candidate, in a separate phase after the timing (one candidate
alive at a time): the peak bytes torch's allocator holds during one steady-state
step, counting everything the candidate holds (model, optimizer state, whatever
is kept between steps) and the step's transients (activations, gradients);
harness.peak_memory. Exact on CUDA; on CPU read from the profiler's allocator
events (torch keeps no CPU counter). "grads MiB" (4 bytes per parameter) is for
reference: backward-fusion frees each gradient right after its update, eager
keeps all of them until zero_grad().

Correctness check, after the timing, from identical copies at a realistic lr
(optim.py's CHECK_LR) with the same dropout masks (the RNG seeded before each
step), over CHECK_STEPS steps: the eager baselines against torch foreach,
element by element by optim.py's rule (compare_updates), each step taken from
foreach's parameters before it (teacher forcing: the optimizer's state
carries over, rounding differences in the parameters do not); the fusion
modes against reprop eager, bit for bit. A mismatch prints a WARNING, and the
run exits with status 1 once the report is printed and the JSON written.

    python benchmarks/fusion.py --quick                       # CI-sized, CPU (~25 s on 2 idle cores)
    python benchmarks/fusion.py --device cuda --json out.json
    python benchmarks/fusion.py --device cuda --sweeps batches --batches 32,64
    python benchmarks/fusion.py --quick --baselines-only      # baselines only (torch's, reprop eager), no reprop.fuse

The host sweep: a chain of --layers Linear(4, 4) layers (2 parameter tensors
each), batch 2, on the CPU: each tensor's update costs next to nothing there, so
what a candidate adds to a step is its host cost (Python, hooks, checks, torch
dispatch). The step's loss is model(x).square().sum(); AdamW as above; the
candidates are the ones above (torch backward with a fused AdamW per tensor),
the floor named "floor", plus

    torch hooks      the floor with the hooks backward mode registers, doing nothing: a
                     post-accumulate-grad hook per tensor, a forward pre-hook per layer

alternated, --reps rounds (default 41, quick 5) of --inner steps (default 20,
quick 5) after --warmup steps (default 5, quick 2), medians. Printed: us per
step, and (step - floor) / tensors, the host cost of the optimizer per
parameter tensor. Samples are the thread's CPU time (time.thread_time), not
wall time: on a shared machine a process that is preempted still counts only
what it ran (the cache it finds cold is counted). After the timing, each fusion
candidate's parameters are checked against its package's eager candidate's, bit
for bit (the same steps on the same data). Run with OMP_NUM_THREADS=1:

    OMP_NUM_THREADS=1 PYTHONPATH=python python benchmarks/fusion.py --sweeps host

To compare two trees, time the other tree's copy of the package in the same run
(--against): in-process alternation follows the load of a shared machine, which
separate processes do not; the paired rounds' differences are printed too.

    cp -r OLD/python/reprop /tmp/ab/reprop_old
    OMP_NUM_THREADS=1 PYTHONPATH=python:/tmp/ab python benchmarks/fusion.py --sweeps host --against \
        reprop_old --only "reprop forward,reprop backward,reprop_old forward,reprop_old backward"
"""

from __future__ import annotations

import copy
import importlib
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from torch import nn

# Run as a script, benchmarks/ is already on sys.path; as `python -m benchmarks.fusion` it is not.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
import models  # noqa: E402
import optim as optim_bench  # noqa: E402  (the optimizer benchmark: its optimizers and factories)

OPTIMIZERS = optim_bench.OPTIMIZERS

# Candidate names, in table order.
FOREACH, FUSED = optim_bench.FOREACH, optim_bench.FUSED
EAGER, FORWARD, BACKWARD, FLOOR = "reprop eager", "reprop forward", "reprop backward", "no optimizer"
# torch's own optimizer-in-backward (per-parameter optimizers stepped in post-accumulate-grad hooks,
# torch's tutorial "How to save memory by fusing the optimizer step into the backward pass"): the
# torch path that does what backward-fusion does. Without it, backward-fusion was compared with
# eager torch steps only.
TORCH_BACKWARD = "torch backward"
TORCH_BASELINES = (FOREACH, FUSED, TORCH_BACKWARD)
BASELINES = (FOREACH, FUSED, TORCH_BACKWARD, EAGER)  # every candidate's speedup is reported against each of these
BASELINE_LABELS = {FOREACH: "foreach", FUSED: "fused", TORCH_BACKWARD: "torch bwd", EAGER: "reprop"}
FUSION_MODES = {FORWARD: "forward", BACKWARD: "backward"}
CHECK_REFERENCE = {FUSED: FOREACH, TORCH_BACKWARD: FOREACH, EAGER: FOREACH, FORWARD: EAGER,
                   BACKWARD: EAGER}  # see check_candidates

SEQ_LEN = 128
MIB = 2**20
SWEEPS = ("models", "batches", "optims", "host")
DEFAULT_SWEEPS = ("models", "batches", "optims")  # host is CPU-only: gpu_session.sh runs the default
# The paper's Figure 6 models; any of models.MODELS can be named with --models.
PAPER_MODELS = "mobilenet_v2,resnet18,resnet50,densenet121,vgg19_bn,transformer_base"
FULL = {"models": PAPER_MODELS, "batches": "8,16,32,64,128",
        "optims": "sgd,adam,adamw,adagrad,adadelta,rmsprop", "batch": 32, "image_size": 224,
        "layers": 150, "inner": 20, "host_reps": 41, "host_warmup": 5}
QUICK = {"models": "mobilenet_v2", "batches": "8", "optims": "adamw,sgd", "batch": 8, "image_size": 64,
         "layers": 150, "inner": 5, "host_reps": 5, "host_warmup": 2}
SWEEP_MODEL, SWEEP_OPTIM = "mobilenet_v2", "adamw"  # fixed in the sweeps that vary something else

# Steps each candidate takes before its memory is measured: the first creates the
# optimizer state, the second leaves whatever a mode keeps between steps.
MEMORY_WARMUP = 2

# Correctness check (check_candidates), over CHECK_STEPS steps: one step cannot tell momentum or
# betas (SGD's first step is the same with any momentum, Adam's with any betas). The fusion modes
# must compute exactly what reprop eager computes (README: bit for bit), so that forward mode's
# updates applied before the next forward are checked too. The eager baselines are compared with
# torch foreach by teacher forcing (teacher_forced_mismatch): left to train freely, from the second
# step on their gradients would see the first update's rounding differences, and Adam's update of a
# gradient that is rounding noise is +-lr either way (measured: AdamW on MobileNetV2, 1.8 rounding
# steps after one step, half a parameter after two). Each step starts from foreach's parameters
# instead, so the gradients are foreach's bit for bit and only the optimizer's own rounding
# differs: measured per step on MobileNetV2 <= 1.95 rounding steps of compare_updates' 4 (AdamW,
# Adam; Adadelta 1.9, RMSprop 1.7, Adagrad 1.0; SGD bitwise), torch fused and reprop eager alike.
CHECK_STEPS = 3
CHECK_SEED = 1

# Targets (CUDA; printed as PASS/MISS, never asserted).
TARGET_SPEEDUP = 1.25        # backward-fusion over torch foreach, MobileNetV2 AdamW at --batch
TARGET_GRAD_SAVING = 0.5     # backward-fusion's peak below reprop eager's, as a fraction of the grads


@dataclass(frozen=True)
class Case:
    """One measured configuration."""

    model: str
    batch: int
    optimizer: str  # key of OPTIMIZERS

    @property
    def label(self) -> str:
        return f"{self.model} b{self.batch} {OPTIMIZERS[self.optimizer].cls}"


@dataclass
class Trainer:
    """One candidate: its model copy, optimizer (None for the floor), fusion handle, and step()."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    handle: object | None
    step: Callable[[], None]

    def close(self) -> None:
        """Apply pending updates and remove the fusion hooks (plain eager again)."""
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


@dataclass
class CaseResult:
    """Everything measured for one case."""

    case: Case
    sweeps: list[str]
    num_tensors: int
    num_params: int
    stats: dict[str, harness.Stats] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)
    peak_bytes: dict[str, int | None] = field(default_factory=dict)
    mismatch: dict[str, str | None] = field(default_factory=dict)  # check_candidates: None or why not equal

    @property
    def grad_bytes(self) -> int:
        return self.num_params * 4  # fp32 gradients, one per parameter

    def median(self, name: str) -> float | None:
        """Median ms of a candidate, None when it was n/a or not run."""
        s = self.stats.get(name)
        return s.median if s else None

    def best_torch(self) -> float | None:
        """The fastest of torch's baselines (ms): foreach, fused, optimizer-in-backward."""
        times = [t for t in map(self.median, TORCH_BASELINES) if t is not None]
        return min(times) if times else None


# ---------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------


def plan_cases(args) -> dict[Case, list[str]]:
    """The cases of the selected sweeps, each once, with the sweeps that contain it."""
    plan: dict[Case, list[str]] = {}

    def add(case: Case, sweep: str) -> None:
        plan.setdefault(case, []).append(sweep)

    if "models" in args.sweeps:
        for name in args.models:
            add(Case(name, args.batch, SWEEP_OPTIM), "models")
    if "batches" in args.sweeps:
        for b in args.batches:
            add(Case(SWEEP_MODEL, b, SWEEP_OPTIM), "batches")
    if "optims" in args.sweeps:
        for opt in args.optims:
            add(Case(SWEEP_MODEL, args.batch, opt), "optims")
    return plan


# ---------------------------------------------------------------------------
# Candidates
# ---------------------------------------------------------------------------


def candidate_names(baselines_only: bool) -> list[str]:
    """Table order; without the fusion modes when only the baselines are timed."""
    fused = [] if baselines_only else list(FUSION_MODES)
    return [*BASELINES, *fused, FLOOR]


def optimizer_factories(optimizer: str, **overrides) -> dict[str, Callable[[list], torch.optim.Optimizer]]:
    """Optimizer constructor of every candidate that has one, by candidate name.

    The fusion modes fuse a reprop.optim optimizer (the same update kernels as
    "reprop eager"), so fused vs eager isolates the reordering. ``overrides``
    replace the optimizer's hyper-parameters (the check's lr).
    """
    base = optim_bench.optimizer_factories(OPTIMIZERS[optimizer], with_reprop=True, **overrides)
    return {FOREACH: base[FOREACH], FUSED: base[FUSED], TORCH_BACKWARD: in_backward_factory(base),
            EAGER: base[optim_bench.REPROP], **{name: base[optim_bench.REPROP] for name in FUSION_MODES}}


class InBackward:
    """torch's optimizer-in-backward: one optimizer per parameter, stepped in the parameter's
    post-accumulate-grad hook, which then frees the gradient (torch's recipe). Not an Optimizer:
    the candidate's step() is forward + backward alone (training_step with in_backward)."""

    def __init__(self, params: list, make: Callable[[list], torch.optim.Optimizer]):
        self.optimizers = {p: make([p]) for p in params}
        self.hooks = [p.register_post_accumulate_grad_hook(self._step) for p in params]

    def _step(self, p: torch.Tensor) -> None:
        opt = self.optimizers[p]
        opt.step()
        opt.zero_grad(set_to_none=True)

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []


def in_backward_factory(base: dict) -> Callable[[list], InBackward]:
    """InBackward over per-parameter torch optimizers: fused where torch builds one for the
    parameter (construction is where it refuses a device), else foreach."""
    def per_param(ps: list) -> torch.optim.Optimizer:
        try:
            return base[FUSED](ps)
        except (RuntimeError, TypeError, ValueError):
            return base[FOREACH](ps)
    return lambda params: InBackward(params, per_param)


def training_step(model: nn.Module, optimizer: torch.optim.Optimizer | InBackward | None,
                  x: torch.Tensor, y: torch.Tensor | None, loss=models.cross_entropy) -> Callable[[], None]:
    """The user's training step, ``loss(model(x), y).backward()`` then the update; without an
    optimizer, forward + backward + zero_grad only; with torch's optimizer-in-backward, forward +
    backward (its hooks step and free the gradients).

    ``optimizer.step`` is looked up at every call: reprop.fuse replaces it on
    the instance.
    """
    def in_backward() -> None:
        loss(model(x), y).backward()

    def step() -> None:
        loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    def floor() -> None:
        loss(model(x), y).backward()
        model.zero_grad()

    if isinstance(optimizer, InBackward):
        return in_backward
    return floor if optimizer is None else step


def make_trainer(name: str, template: nn.Module, factory, batch: tuple[torch.Tensor, torch.Tensor | None],
                 device: torch.device, mode: str | None = None, loss=models.cross_entropy) -> Trainer:
    """A fresh copy of ``template`` on ``device``, the candidate's optimizer and fusion, its step().

    A fusion candidate (``mode``, by default FUSION_MODES[name]) is named "PACKAGE MODE" and fused
    by that package's fuse(): reprop's, or another tree's copy (the host sweep's --against).
    """
    model = copy.deepcopy(template).to(device).train()
    optimizer = factory(list(model.parameters())) if factory is not None else None
    handle = optimizer if isinstance(optimizer, InBackward) else None  # close() removes its hooks
    mode = mode or FUSION_MODES.get(name)
    if mode is not None:
        package = importlib.import_module(name.partition(" ")[0])
        handle = package.fuse(model, optimizer, mode=mode)
    return Trainer(model, optimizer, handle, training_step(model, optimizer, *batch, loss=loss))


def try_trainer(name: str, template: nn.Module, factory, batch, device: torch.device) -> Trainer | str:
    """make_trainer plus one probe step; the reason as a string when the candidate is n/a here.

    torch raises for an unsupported fused optimizer/device at construction or
    only at the first step; the probe also creates the optimizer state.
    """
    try:
        trainer = make_trainer(name, template, factory, batch, device)
        trainer.step()
    except Exception as e:  # noqa: BLE001 - any failure means "n/a here", with the reason shown
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    return trainer


def checked_step(trainer: Trainer, i: int) -> None:
    """The check's step ``i``, the RNG seeded alike in every candidate: the same dropout masks."""
    torch.manual_seed(CHECK_SEED + i)
    trainer.step()


def params_of(trainer: Trainer) -> dict[str, torch.Tensor]:
    """A copy of the trainer's parameters, by name."""
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def checked_params(name: str, template: nn.Module, factory, batch, device: torch.device) -> dict[str, torch.Tensor]:
    """A fresh ``name`` trainer's parameters after CHECK_STEPS checked steps; close() applies
    forward mode's pending updates."""
    trainer = make_trainer(name, template, factory, batch, device)
    for i in range(CHECK_STEPS):
        checked_step(trainer, i)
    trainer.close()
    return params_of(trainer)


def reference_steps(template: nn.Module, factory, batch, device: torch.device) -> list[dict[str, torch.Tensor]]:
    """torch foreach's parameters before the first checked step and after each of CHECK_STEPS."""
    trainer = make_trainer(FOREACH, template, factory, batch, device)
    snapshots = [params_of(trainer)]
    for i in range(CHECK_STEPS):
        checked_step(trainer, i)
        snapshots.append(params_of(trainer))
    return snapshots


def teacher_forced_mismatch(name: str, spec: optim_bench.OptimSpec, snapshots: list[dict[str, torch.Tensor]],
                            template: nn.Module, factory, batch, device: torch.device) -> str | None:
    """None when each checked step of a fresh ``name`` trainer, from torch foreach's parameters
    before it (``snapshots``, reference_steps), gives foreach's after it, else why not.

    The trainer's optimizer state carries over from step to step, as in
    training, so momentum and betas are compared; its parameters are set to
    foreach's at each step, so their gradients are foreach's and each step's
    update is compared by optim.py's rule (compare_updates) on its own.
    """
    trainer = make_trainer(name, template, factory, batch, device)
    params = dict(trainer.model.named_parameters())
    for i, (before, after) in enumerate(zip(snapshots, snapshots[1:])):
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(before[n])
        checked_step(trainer, i)
        why = optim_bench.compare_updates(spec, {n: p.detach() for n, p in params.items()}, after, before, device)
        if why is not None:
            return f"step {i + 1} of {CHECK_STEPS}: {why}"
    return None


def check_candidates(result: CaseResult, template: nn.Module, batch, device: torch.device) -> None:
    """Record in result.mismatch whether each timed candidate computes what its reference does.

    See CHECK_STEPS: the eager baselines against torch foreach, teacher forced
    (optim.py's rule: bitwise for SGD on the CPU, else a few rounding steps),
    the fusion modes against reprop eager, bitwise.
    """
    spec = OPTIMIZERS[result.case.optimizer]
    factories = optimizer_factories(result.case.optimizer, lr=optim_bench.CHECK_LR)

    def checked(ref: str) -> list[str]:
        return [n for n, r in CHECK_REFERENCE.items() if r == ref and n in result.stats] if ref in result.stats else []

    with harness.reproducible():  # the same gradients from the same parameters, on CUDA too
        if checked(FOREACH):
            snapshots = reference_steps(template, factories[FOREACH], batch, device)
            for name in checked(FOREACH):
                result.mismatch[name] = teacher_forced_mismatch(name, spec, snapshots, template, factories[name],
                                                                batch, device)
        if checked(EAGER):
            want = checked_params(EAGER, template, factories[EAGER], batch, device)
            for name in checked(EAGER):
                got = checked_params(name, template, factories[name], batch, device)
                result.mismatch[name] = harness.check_close(got, want, rtol=0.0, atol=0.0)
    harness.release(device)


# ---------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------


def time_candidates(result: CaseResult, template: nn.Module, batch, factories: dict,
                    names: list[str], device: torch.device, args) -> None:
    """Build every candidate and time them alternated."""
    trainers: dict[str, Trainer] = {}
    for name in names:
        got = try_trainer(name, template, factories.get(name), batch, device)
        if isinstance(got, str):
            result.unavailable[name] = got
        else:
            trainers[name] = got
    result.stats = harness.measure_alternated({n: t.step for n, t in trainers.items()}, device,
                                              args.warmup, args.reps)
    for trainer in trainers.values():
        trainer.close()
    trainers.clear()
    harness.release(device)


def measure_peaks(result: CaseResult, template: nn.Module, batch, factories: dict,
                  device: torch.device) -> None:
    """Peak memory of one steady-state step of each timed candidate, one candidate alive at a time."""
    for name in result.stats:
        holder: list[Trainer] = []

        def setup() -> None:
            holder.append(make_trainer(name, template, factories.get(name), batch, device))
            for _ in range(MEMORY_WARMUP):
                holder[0].step()

        result.peak_bytes[name] = harness.peak_memory(lambda: holder[0].step(), device, setup)
        holder[0].close()
        holder.clear()
        harness.release(device)


def run_case(case: Case, sweeps: list[str], device: torch.device, args) -> CaseResult:
    """Time all candidates of one case, check what they compute, then measure their peak memory."""
    torch.manual_seed(0)
    template = models.build(case.model)  # on the CPU; every candidate copies it to the device
    batch = models.make_batch(case.model, case.batch, device, args.image_size, SEQ_LEN)
    result = CaseResult(case, sweeps, *models.param_counts(template))
    factories = optimizer_factories(case.optimizer)
    names = candidate_names(args.baselines_only)
    time_candidates(result, template, batch, factories, names, device, args)
    check_candidates(result, template, batch, device)
    measure_peaks(result, template, batch, factories, device)
    return result


# ---------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------


def ratio(peer_ms: float | None, ours_ms: float | None) -> float | None:
    """harness.speedup, None where either side is missing."""
    return harness.speedup(peer_ms, ours_ms) if peer_ms and ours_ms else None


def mib(nbytes: int | None) -> float | None:
    return None if nbytes is None else nbytes / MIB


def detail_rows(result: CaseResult, names: list[str]) -> list[dict]:
    """One row per candidate: time, spread, speedup over each baseline, peak memory."""
    eager_peak = result.peak_bytes.get(EAGER)
    rows = []
    for name in names:
        ms = result.median(name)
        s = result.stats.get(name)
        peak = result.peak_bytes.get(name)
        rows.append({
            "case": result.case.label,
            "candidate": name,
            "ms": ms,
            "iqr": s.iqr / s.median if s else None,
            **{f"x_{b}": ratio(result.median(b), ms) for b in BASELINES},
            "peak_mib": mib(peak),
            "peak_vs_eager_mib": mib(peak - eager_peak) if peak is not None and eager_peak is not None else None,
            "unavailable": result.unavailable.get(name),
        })
    return rows


def summary_row(result: CaseResult) -> dict:
    """The paper's figures for one case: optimizer share, speedups, time saved, memory saved."""
    foreach, best, floor = result.median(FOREACH), result.best_torch(), result.median(FLOOR)
    row = {
        "case": result.case.label,
        "sweeps": ",".join(result.sweeps),
        "tensors": result.num_tensors,
        "params_per_tensor": result.num_params / result.num_tensors,  # Figure 6's x axis
        "grads_mib": result.grad_bytes / MIB,
        # Figure 7's x axis: the optimizer's share of an eager step.
        "opt_share_foreach": (foreach - floor) / foreach if foreach and floor else None,
        "opt_share_eager": ((result.median(EAGER) - floor) / result.median(EAGER)
                            if result.median(EAGER) and floor else None),
    }
    for name, tag in ((FORWARD, "ff"), (BACKWARD, "bf")):
        ms = result.median(name)
        row[f"{tag}_x_foreach"] = ratio(foreach, ms)
        row[f"{tag}_x_best_torch"] = ratio(best, ms)
        row[f"{tag}_saved_ms"] = foreach - ms if foreach and ms else None  # Figure 4
    row["bf_x_torch_backward"] = ratio(result.median(TORCH_BACKWARD), result.median(BACKWARD))
    eager_peak, bf_peak = result.peak_bytes.get(EAGER), result.peak_bytes.get(BACKWARD)
    row["bf_peak_saving_of_grads"] = ((eager_peak - bf_peak) / result.grad_bytes
                                      if eager_peak is not None and bf_peak is not None else None)
    return row


def format_details(rows: list[dict]) -> str:
    """The per-candidate table: n/a where a candidate is unavailable, - where not measured."""
    headers = ["case", "candidate", "ms", "IQR", *(f"x {BASELINE_LABELS[b]}" for b in BASELINES), "peak MiB",
               "vs eager MiB"]
    out = []
    for r in rows:
        if r["unavailable"]:
            out.append([r["case"], r["candidate"]] + ["n/a"] * (len(headers) - 2))
            continue
        out.append([r["case"], r["candidate"], harness.fmt(r["ms"], ".2f"), pct(r["iqr"]),
                    *(harness.fmt(r[f"x_{b}"], ".2f") for b in BASELINES),
                    harness.fmt(r["peak_mib"], ".1f"), harness.fmt(r["peak_vs_eager_mib"], "+.1f")])
    return harness.format_table(headers, out)


def format_summary(rows: list[dict]) -> str:
    """The per-case table of the paper's quantities (FF forward-, BF backward-fusion)."""
    headers = ["case", "sweeps", "tensors", "params/tensor", "grads MiB", "opt share", "FF x foreach",
               "BF x foreach", "BF x torch bwd", "FF x best torch", "BF x best torch", "FF saved ms",
               "BF saved ms", "BF peak saving / grads"]
    out = [[r["case"], r["sweeps"], r["tensors"], f"{r['params_per_tensor']:,.0f}",
            harness.fmt(r["grads_mib"], ".1f"), pct(r["opt_share_foreach"]),
            *(harness.fmt(r[k], ".2f") for k in ("ff_x_foreach", "bf_x_foreach", "bf_x_torch_backward",
                                                  "ff_x_best_torch", "bf_x_best_torch", "ff_saved_ms",
                                                  "bf_saved_ms")),
            pct(r["bf_peak_saving_of_grads"])] for r in rows]
    return harness.format_table(headers, out)


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def evaluate_targets(results: list[CaseResult], args) -> list[dict]:
    """The goals (for CUDA): speedup at the reference case, never slower, memory saved.

    1. MobileNetV2, AdamW, batch --batch: backward-fusion >= TARGET_SPEEDUP x torch foreach.
    2. Every batch of the batch sweep: both fusion modes at least as fast as
       the fastest torch baseline (foreach, fused or optimizer-in-backward; speedup >= 1;
       the IQR says how close a tie is).
    3. Every case: backward-fusion's peak memory below reprop eager's by at
       least TARGET_GRAD_SAVING of the gradients' size. Not all of it: eager's
       peak is often early in backward, when the activations are still alive
       and only the last layers' gradients exist, so fusion can only save those.
    """
    checks = []
    for res in results:
        bf, ff = res.median(BACKWARD), res.median(FORWARD)
        if bf is None:
            continue
        c = res.case
        if (c.model, c.optimizer, c.batch) == (SWEEP_MODEL, SWEEP_OPTIM, args.batch) and res.median(FOREACH):
            x = ratio(res.median(FOREACH), bf)
            checks.append({"case": c.label, "target": f"backward >= {TARGET_SPEEDUP} x torch foreach",
                           "value": f"{x:.2f}", "pass": x >= TARGET_SPEEDUP})
        if "batches" in res.sweeps and ff is not None and res.best_torch():
            xf, xb = ratio(res.best_torch(), ff), ratio(res.best_torch(), bf)
            spread = max(s.iqr / s.median for s in res.stats.values())
            checks.append({"case": c.label, "target": "forward and backward >= best torch baseline",
                           "value": f"forward {xf:.2f}, backward {xb:.2f}, widest IQR {spread:.0%}",
                           "pass": min(xf, xb) >= 1.0})
        eager_peak, bf_peak = res.peak_bytes.get(EAGER), res.peak_bytes.get(BACKWARD)
        if eager_peak is not None and bf_peak is not None:
            saved = eager_peak - bf_peak
            checks.append({"case": c.label,
                           "target": f"backward peak <= eager peak - {TARGET_GRAD_SAVING:.0%} of grads",
                           "value": f"saves {saved / MIB:.1f} MiB = {saved / res.grad_bytes:.0%} of "
                                    f"{res.grad_bytes / MIB:.1f} MiB grads",
                           "pass": saved >= TARGET_GRAD_SAVING * res.grad_bytes})
    return checks


def print_report(results: list[CaseResult], names: list[str], checks: list[dict], info: dict,
                 args) -> None:
    """Machine lines, settings, the per-candidate and per-case tables, notes, targets."""
    print(harness.describe_machine(info))
    print(f"device {args.device}; median of {args.reps} rounds (candidates alternated, rotating), "
          f"{args.warmup} warm-up step(s) each after a probe step; fp32; images {args.image_size}x"
          f"{args.image_size}, tokens {SEQ_LEN}; lr {optim_bench.LR:g}")
    print("x <baseline> = baseline ms / candidate ms (> 1: candidate faster); IQR relative to the median;")
    print("peak = torch allocator's peak during one steady-state step, one candidate alive "
          f"({'exact, CUDA counters' if args.device == 'cuda' else 'CPU: from profiler allocation events'}); "
          "vs eager = peak - reprop eager's peak\n")
    print(format_details([row for res in results for row in detail_rows(res, names)]))
    if any(res.median(FORWARD) or res.median(BACKWARD) for res in results):
        print("\nopt share = (torch foreach - no optimizer) / torch foreach; FF/BF = forward-/backward-"
              "fusion; torch bwd = torch's optimizer-in-backward; best torch = the fastest of torch foreach, "
              "fused and bwd; saved ms = torch foreach - fusion\n")
        print(format_summary([summary_row(res) for res in results]))
    for res in results:
        for name, why in res.unavailable.items():
            print(f"n/a: {res.case.label} {name}: {why}")
        for name, why in res.mismatch.items():
            if why is not None:
                print(f"WARNING: {res.case.label} {name}: not the parameters {CHECK_REFERENCE[name]} has "
                      f"after the same steps: {why}")
    checked = [why for res in results for why in res.mismatch.values()]
    if checked:
        bitwise = ", ".join(s.cls for s in OPTIMIZERS.values() if s.bitwise)
        print(f"\nparameters from the same start, lr {optim_bench.CHECK_LR:g}, the same dropout masks: "
              f"torch fused, torch backward and reprop eager = torch foreach's at each of {CHECK_STEPS} steps, each "
              "from foreach's "
              f"parameters before it (bitwise: {bitwise}, on the CPU; the others within {optim_bench.CHECK_ULPS} x "
              f"eps x (|p| + that step's largest update)), reprop forward and backward = "
              f"reprop eager's bit for bit after {CHECK_STEPS} steps: "
              f"{'ok' if all(why is None for why in checked) else 'WARNING: see above'}")
    if checks:
        print(f"\ntargets{'' if args.device == 'cuda' else ' (goals for CUDA; on CPU for information)'}:")
        for c in checks:
            print(f"  {'PASS' if c['pass'] else 'MISS'}  {c['case']}: {c['target']} ({c['value']})")


def json_payload(results: list[CaseResult], names: list[str], checks: list[dict], info: dict,
                 args) -> dict:
    """All settings, every candidate's statistics and peak, both tables' rows, the targets."""
    return {
        "benchmark": "fusion",
        "machine": info,
        "config": {k: v for k, v in vars(args).items() if k != "json"} | {
            "lr": optim_bench.LR, "seq_len": SEQ_LEN,
            "check": {"lr": optim_bench.CHECK_LR, "steps": CHECK_STEPS, "ulps": optim_bench.CHECK_ULPS}},
        "cases": [{
            "model": r.case.model, "batch": r.case.batch, "optimizer": r.case.optimizer,
            "sweeps": r.sweeps, "tensors": r.num_tensors, "params": r.num_params,
            "grad_bytes": r.grad_bytes,
            "stats_ms": {n: s.to_dict() for n, s in r.stats.items()},
            "peak_bytes": r.peak_bytes,
            "unavailable": r.unavailable,
            "mismatch": r.mismatch,
        } for r in results],
        "rows": [row for res in results for row in detail_rows(res, names)],
        "summary": [summary_row(res) for res in results],
        "targets": checks,
    }


# ---------------------------------------------------------------------------
# The host sweep: the hook modes' host cost per parameter tensor (CPU)
# ---------------------------------------------------------------------------

HOST_FLOOR, TORCH_HOOKS = "floor", "torch hooks"
CPU = torch.device("cpu")


@dataclass
class HostResult:
    """The host sweep's samples (us per step, in the order taken) and its bitwise check's problems."""

    layers: int
    tensors: int
    samples: dict[str, list[float]]
    problems: list[str]

    def rows(self) -> list[dict]:
        """Per candidate: median and quartiles (us per step), host cost per tensor over the floor."""
        floor = statistics.median(self.samples[HOST_FLOOR])
        rows = []
        for name, samples in self.samples.items():
            s = harness.Stats.from_samples(samples)
            rows.append({"candidate": name, "us_step": s.median, "q1": s.q1, "q3": s.q3,
                         "us_tensor_over_floor": None if name == HOST_FLOOR else (s.median - floor) / self.tensors})
        return rows


def square_sum(out: torch.Tensor, _: None) -> torch.Tensor:
    """The host sweep's loss: no labels, next to no work."""
    return out.square().sum()


def hooks_only(model: nn.Module) -> None:
    """The hooks backward mode registers, doing nothing: torch's own cost of calling them."""
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: None)
    for module in model.modules():
        if any(True for _ in module.parameters(recurse=False)):
            module.register_forward_pre_hook(lambda module, args: None)


def host_candidates(against: list[str], baselines_only: bool) -> dict[str, tuple[Callable | None, str | None]]:
    """Candidate -> (optimizer factory, fusion mode), in table order: the floor, torch's
    hooks and steps, then each package's (reprop's, then --against's) eager and fusion modes."""
    factories = optimizer_factories(SWEEP_OPTIM)
    candidates = {HOST_FLOOR: (None, None), TORCH_HOOKS: (None, None),
                  **{name: (factories[name], None) for name in TORCH_BASELINES}}
    kwargs = OPTIMIZERS[SWEEP_OPTIM].kwargs
    for package in ("reprop", *against):
        cls = getattr(importlib.import_module(f"{package}.optim"), OPTIMIZERS[SWEEP_OPTIM].cls)
        make = lambda ps, cls=cls: cls(ps, **kwargs)  # noqa: E731
        modes = ("eager",) if baselines_only else ("eager", *FUSION_MODES.values())
        candidates.update({f"{package} {mode}": (make, None if mode == "eager" else mode) for mode in modes})
    return candidates


def host_mismatches(trainers: dict[str, Trainer]) -> list[str]:
    """The fusion candidates whose parameters differ from those of their package's eager
    candidate (when it ran), bit for bit, after the same steps; close() applies forward
    mode's pending updates first."""
    problems = []
    for name, trainer in trainers.items():
        package, _, mode = name.rpartition(" ")
        eager = trainers.get(f"{package} eager")  # none for torch's: "torch backward" is not checked here
        if mode not in FUSION_MODES.values() or eager is None:
            continue
        trainer.close()
        for (pname, p), q in zip(trainer.model.named_parameters(), eager.model.parameters()):
            if not torch.equal(p, q):
                problems.append(f"{name}: {pname} differs from {package} eager's")
                break
    return problems


def run_host_sweep(args) -> HostResult:
    """Build the host sweep's candidates (those of --only and the floor), time them alternated
    in thread CPU time, then check the fusion candidates bit for bit."""
    torch.manual_seed(0)
    template = nn.Sequential(*(nn.Linear(4, 4) for _ in range(args.layers)))
    x = torch.randn(2, 4)
    trainers = {}
    for name, (factory, mode) in host_candidates(args.against, args.baselines_only).items():
        if args.only and name not in args.only and name != HOST_FLOOR:
            continue
        trainers[name] = make_trainer(name, template, factory, (x, None), CPU, mode=mode, loss=square_sum)
        if name == TORCH_HOOKS:
            hooks_only(trainers[name].model)
    stats = harness.measure_alternated({n: t.step for n, t in trainers.items()}, CPU, args.host_warmup,
                                       args.host_reps, args.inner, clock=time.thread_time)
    problems = host_mismatches(trainers)
    for trainer in trainers.values():
        trainer.close()
    harness.release(CPU)
    return HostResult(args.layers, sum(1 for _ in template.parameters()),
                      {n: [1e3 * t for t in s.samples] for n, s in stats.items()}, problems)


def print_paired(samples: dict, other: str, tensors: int) -> None:
    """reprop's candidates against `other`'s, sample by sample (the two were
    timed in the same round, so under the same load): the median of the
    per-round differences, in us per step and per tensor, and of the ratios."""
    for mode in ("eager", *FUSION_MODES.values()):
        ours, theirs = samples.get(f"reprop {mode}"), samples.get(f"{other} {mode}")
        if ours is None or theirs is None:
            continue
        diff = statistics.median(a - b for a, b in zip(ours, theirs))
        ratio = statistics.median(a / b for a, b in zip(ours, theirs))
        print(f"reprop {mode} - {other} {mode}: {diff:+.0f} us/step, {diff / tensors:+.2f} "
              f"us/tensor (median of paired rounds); ratio {ratio:.3f}")


def print_host_report(result: HostResult, against: Iterable[str]) -> None:
    """The host sweep's table, the paired rounds against each --against package, the check."""
    print(f"# {result.layers} x Linear(4, 4): {result.tensors} tensors; torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s), reprop at {harness.git_commit()}")
    rows = [(r["candidate"], f"{r['us_step']:.0f}", f"{r['q1']:.0f}-{r['q3']:.0f}",
             "" if r["us_tensor_over_floor"] is None else f"{r['us_tensor_over_floor']:.2f}")
            for r in result.rows()]
    print(harness.format_table(["candidate", "us/step (CPU)", "IQR", "us/tensor over floor"], rows))
    for other in against:
        print_paired(result.samples, other, result.tensors)
    harness.print_check("fusion candidates equal their eager candidate bit for bit", result.problems)


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------


def parse_list(text: str, convert=str) -> list:
    """Comma-separated values, empty items dropped."""
    return [convert(v) for v in text.split(",") if v.strip()]


def parse_args():
    """Shared harness options plus the sweeps' settings (defaults from --quick)."""
    p = harness.make_parser(__doc__.splitlines()[0])
    p.add_argument("--sweeps", default=",".join(DEFAULT_SWEEPS),
                   help=f"which of {','.join(SWEEPS)} (default {','.join(DEFAULT_SWEEPS)}; host is CPU-only)")
    p.add_argument("--models", default=None,
                   help=f"models of the models sweep (default {FULL['models']}; quick {QUICK['models']})")
    p.add_argument("--batches", default=None,
                   help=f"MobileNetV2 batch sizes of the batches sweep (default {FULL['batches']}; "
                        f"quick {QUICK['batches']})")
    p.add_argument("--optims", default=None,
                   help=f"optimizers of the optims sweep (default {FULL['optims']}; quick {QUICK['optims']})")
    p.add_argument("--batch", type=int, default=None,
                   help=f"batch size of the models and optims sweeps (default {FULL['batch']}; quick {QUICK['batch']})")
    p.add_argument("--image-size", type=int, default=None,
                   help=f"image height and width (default {FULL['image_size']}; quick {QUICK['image_size']})")
    p.add_argument("--baselines-only", action="store_true",
                   help="time the baselines (torch's and reprop eager) and the floor only (no reprop.fuse needed)")
    p.add_argument("--layers", type=int, default=None,
                   help=f"host sweep: Linear(4, 4) layers (default {FULL['layers']}; quick {QUICK['layers']})")
    p.add_argument("--inner", type=int, default=None,
                   help=f"host sweep: steps per sample (default {FULL['inner']}; quick {QUICK['inner']})")
    p.add_argument("--only", default="", help="host sweep: comma-separated candidates (default all; the floor always)")
    p.add_argument("--against", default="", help=(
        "host sweep: comma-separated names of other copies of the reprop package to time in the same run "
        "(another tree's python/reprop copied to DIR/NAME, DIR on PYTHONPATH): their eager, "
        "forward and backward candidates, named NAME eager etc."))
    args = p.parse_args()
    defaults = QUICK if args.quick else FULL
    # the host sweep's own defaults where --reps and --warmup are not given: its samples are
    # cheap and noisier (thread CPU time of tiny steps on a shared machine)
    args.host_reps = defaults["host_reps"] if args.reps is None else args.reps
    args.host_warmup = defaults["host_warmup"] if args.warmup is None else args.warmup
    for key in ("models", "batches", "optims", "batch", "image_size", "layers", "inner"):
        if getattr(args, key) is None:
            setattr(args, key, defaults[key])
    args.sweeps = parse_list(args.sweeps)
    args.models = parse_list(args.models)
    args.batches = parse_list(args.batches, int)
    args.optims = parse_list(args.optims)
    for what, given, known in (("--sweeps", args.sweeps, SWEEPS), ("--models", args.models, models.MODELS),
                               ("--optims", args.optims, OPTIMIZERS)):
        unknown = [v for v in given if v not in known]
        if unknown:
            p.error(f"{what}: unknown {', '.join(unknown)}; known: {', '.join(known)}")
    check_host_args(p, args)
    if args.reps is None:
        args.reps = 15 if args.quick else 20
    if args.warmup is None:
        args.warmup = 2 if args.quick else 3
    return args


def check_host_args(p, args) -> None:
    """The host sweep's options: only with it, on the CPU; --against's packages importable."""
    args.only = parse_list(args.only)
    if "host" not in args.sweeps:
        if args.only or args.against:
            p.error("--only and --against are options of the host sweep: add --sweeps host")
        args.against = []
        return
    if args.device != "cpu":
        p.error("--sweeps host: the host sweep runs on the CPU only (--device cpu)")
    if args.layers < 1 or args.inner < 1:
        p.error(f"--layers and --inner: expected positive integers, got {args.layers} and {args.inner}")
    args.against = parse_list(args.against)
    for name in args.against:
        try:
            importlib.import_module(f"{name}.optim")
        except ImportError as e:
            p.error(f"--against: cannot import {name}.optim ({e}); copy another tree's python/reprop to "
                    f"DIR/{name} and put DIR on PYTHONPATH")


def check_reprop(device: torch.device, baselines_only: bool) -> None:
    """Exit with a clear message when reprop (its fuse, its CUDA build) is missing."""
    try:
        import reprop
        import reprop.optim  # noqa: F401
    except Exception as e:  # noqa: BLE001
        raise SystemExit(f"cannot import reprop.optim ({type(e).__name__}: {e}); install it (pip install -e .)")
    if not baselines_only and not hasattr(reprop, "fuse"):
        raise SystemExit("this reprop has no reprop.fuse; pass --baselines-only to time the eager baselines")
    if device.type == "cuda" and not reprop.cuda_available():
        raise SystemExit("reprop.cuda_available() is False: this build has no CUDA kernels")


def main() -> None:
    args = parse_args()
    device = harness.setup_device(args)
    check_reprop(device, args.baselines_only)
    info = harness.machine_info(device)
    names = candidate_names(args.baselines_only)
    results = []
    for case, sweeps in plan_cases(args).items():
        print(f"... {case.label} ({', '.join(sweeps)})", file=sys.stderr, flush=True)
        results.append(run_case(case, sweeps, device, args))
    checks = evaluate_targets(results, args)
    if results:
        print_report(results, names, checks, info, args)
    payload = json_payload(results, names, checks, info, args)
    host = None
    if "host" in args.sweeps:
        print("... host", file=sys.stderr, flush=True)
        host = run_host_sweep(args)
        print_host_report(host, args.against)
        payload["host"] = {"layers": host.layers, "tensors": host.tensors, "rows": host.rows(),
                           "samples_us": host.samples, "mismatch": host.problems}
    harness.write_json(args.json, payload)
    harness.exit_if_failed(any(why is not None for res in results for why in res.mismatch.values())
                           or bool(host and host.problems))


if __name__ == "__main__":
    main()
