"""Host cost per parameter of reprop.fuse's hook modes, on a model of many tiny tensors.

A chain of --layers Linear(4, 4) layers (2 parameter tensors each), batch 2, on the
CPU: each tensor's update costs next to nothing there, so what a candidate adds to
a step is its host cost (Python, hooks, checks, torch dispatch). One step is

    loss = model(x).square().sum(); loss.backward(); optimizer.step(); optimizer.zero_grad()

Candidates, each training its own copy of the model, AdamW (lr 1e-6, weight decay
0.01), alternated as harness.measure_alternated does (each round one sample of
every candidate, the first rotating), medians:

    floor            forward + backward + zero_grad, no update
    torch hooks      floor with the hooks backward mode registers, doing nothing: a
                     post-accumulate-grad hook per tensor, a forward pre-hook per layer
    torch foreach    torch.optim.AdamW(foreach=True)
    torch fused      torch.optim.AdamW(fused=True)
    torch backward   torch's optimizer-in-backward: a fused AdamW per tensor, stepped in its
                     post-accumulate-grad hook (benchmarks/fusion.py's InBackward)
    reprop eager     reprop.optim.AdamW
    reprop forward   reprop.fuse(model, reprop.optim.AdamW(...), mode="forward")
    reprop backward  reprop.fuse(model, reprop.optim.AdamW(...), mode="backward")

After the timing, each fusion candidate's parameters are checked against its
package's eager candidate's, bit for bit (the same steps on the same data): a
mismatch prints a WARNING and the run exits with status 1.

Printed: us per step, and (step - floor) / tensors, the host cost of the optimizer
per parameter tensor. Samples are the thread's CPU time (time.thread_time), not
wall time: on a shared machine a process that is preempted still counts only what
it ran (the cache it finds cold is counted). Run with OMP_NUM_THREADS=1:

    OMP_NUM_THREADS=1 PYTHONPATH=python python benchmarks/fusion_host.py

To compare two trees, time the other tree's copy of the package in the same run
(--against): in-process alternation follows the load of a shared machine, which
separate processes do not; the paired rounds' differences are printed too.

    cp -r OLD/python/reprop /tmp/ab/reprop_old
    OMP_NUM_THREADS=1 PYTHONPATH=python:/tmp/ab python benchmarks/fusion_host.py --against \
        reprop_old --only "reprop forward,reprop backward,reprop_old forward,reprop_old backward"
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib
import os
import statistics
import sys
import time
from typing import Iterable

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
from fusion import InBackward  # noqa: E402  (benchmarks/fusion.py)

import reprop  # noqa: E402

HPARAMS = {"lr": 1e-6, "weight_decay": 0.01}


def make_model(layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(4, 4) for _ in range(layers)))


def make_step(model: nn.Module, optimizer, x: torch.Tensor):
    def step() -> None:
        loss = model(x).square().sum()
        loss.backward()
        if isinstance(optimizer, InBackward):
            return
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad()
        else:
            model.zero_grad()
    return step


def hooks_only(model: nn.Module) -> None:
    """The hooks backward mode registers, doing nothing: torch's own cost of calling them."""
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: None)
    for module in model.modules():
        if any(True for _ in module.parameters(recurse=False)):
            module.register_forward_pre_hook(lambda module, args: None)


def measure(steps: dict, reps: int, inner: int) -> dict:
    """name -> thread CPU times (us per step) of `reps` samples of `inner` steps,
    the candidates alternated, the first of each round rotating."""
    names = list(steps)
    for f in steps.values():
        for _ in range(5):
            f()
    samples = {name: [] for name in names}
    for r in range(reps):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            t0 = time.thread_time()
            for _ in range(inner):
                steps[name]()
            samples[name].append((time.thread_time() - t0) * 1e6 / inner)
    return samples


def reprop_makers(package) -> dict:
    """The reprop candidates of `package` (reprop, or a copy of another tree's: --against)."""
    make = functools.partial(package.optim.AdamW, **HPARAMS)
    return {f"{package.__name__} {mode}": (make, mode)
            for mode in ("eager", "forward", "backward")}


def candidates(template: nn.Module, x: torch.Tensor, against: list) -> tuple[dict, dict, dict]:
    """name -> step function, name -> model it trains, and name -> fusion handle."""
    steps, models, handles = {}, {}, {}
    makers = {
        "floor": (None, None),
        "torch hooks": (None, None),
        "torch foreach": (lambda ps: torch.optim.AdamW(ps, foreach=True, **HPARAMS), None),
        "torch fused": (lambda ps: torch.optim.AdamW(ps, fused=True, **HPARAMS), None),
        "torch backward": (lambda ps: InBackward(
            ps, lambda one: torch.optim.AdamW(one, fused=True, **HPARAMS)), None),
    }
    for package in [reprop, *against]:
        makers.update(reprop_makers(package))
    for name, (make, mode) in makers.items():
        model = models[name] = copy.deepcopy(template)
        opt = make(list(model.parameters())) if make else None
        if name == "torch hooks":
            hooks_only(model)
        if mode in ("forward", "backward"):
            handles[name] = sys.modules[type(opt).__module__.rpartition(".")[0]].fuse(
                model, opt, mode=mode)
        steps[name] = make_step(model, opt, x)
    return steps, models, handles


def fusion_mismatches(ran: Iterable[str], models: dict, handles: dict) -> list[str]:
    """The fusion candidates (of those that ran) whose parameters differ from
    those of their package's eager candidate, bit for bit, after the same
    steps (forward mode's pending updates applied first)."""
    problems = []
    for name, handle in handles.items():
        eager = f"{name.rpartition(' ')[0]} eager"
        if name not in ran or eager not in ran:
            continue
        handle.flush()
        for (pname, p), q in zip(models[name].named_parameters(), models[eager].parameters()):
            if not torch.equal(p, q):
                problems.append(f"{name}: {pname} differs from {eager}'s")
                break
    return problems


def print_paired(samples: dict, other: str, tensors: int) -> None:
    """reprop's candidates against `other`'s, sample by sample (the two were
    timed in the same round, so under the same load): the median of the
    per-round differences, in us per step and per tensor, and of the ratios."""
    for mode in ("eager", "forward", "backward"):
        ours, theirs = samples.get(f"reprop {mode}"), samples.get(f"{other} {mode}")
        if ours is None or theirs is None:
            continue
        diff = statistics.median(a - b for a, b in zip(ours, theirs))
        ratio = statistics.median(a / b for a, b in zip(ours, theirs))
        print(f"reprop {mode} - {other} {mode}: {diff:+.0f} us/step, {diff / tensors:+.2f} "
              f"us/tensor (median of paired rounds); ratio {ratio:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=150, help="Linear(4, 4) layers (default 150)")
    parser.add_argument("--reps", type=int, default=41, help="alternated rounds (default 41)")
    parser.add_argument("--inner", type=int, default=20, help="steps per sample (default 20)")
    parser.add_argument("--only", default="", help="comma-separated candidates (default all)")
    parser.add_argument("--against", default="", help=(
        "comma-separated names of other copies of the reprop package to time in the same run "
        "(another tree's python/reprop copied to DIR/NAME, DIR on PYTHONPATH): their eager, "
        "forward and backward candidates, named NAME eager etc."))
    args = parser.parse_args()
    against = [importlib.import_module(name) for name in filter(None, args.against.split(","))]
    template = make_model(args.layers)
    tensors = sum(1 for _ in template.parameters())
    x = torch.randn(2, 4)
    steps, models, handles = candidates(template, x, against)
    if args.only:
        wanted = set(args.only.split(","))
        steps = {n: f for n, f in steps.items() if n in wanted or n == "floor"}
    samples = measure(steps, args.reps, args.inner)
    floor = statistics.median(samples["floor"])
    print(f"# {args.layers} x Linear(4, 4): {tensors} tensors; torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s), reprop at {harness.git_commit()}")
    rows = []
    for name, s in samples.items():
        q1, median, q3 = statistics.quantiles(s, n=4)
        rows.append((name, f"{median:.0f}", f"{q1:.0f}-{q3:.0f}",
                     "" if name == "floor" else f"{(median - floor) / tensors:.2f}"))
    print(harness.format_table(["candidate", "us/step (CPU)", "IQR", "us/tensor over floor"],
                               rows))
    for package in against:
        print_paired(samples, package.__name__, tensors)
    problems = fusion_mismatches(samples, models, handles)
    harness.print_check("fusion candidates equal their eager candidate bit for bit", problems)
    for handle in handles.values():
        handle.remove()
    harness.exit_if_failed(bool(problems))


if __name__ == "__main__":
    main()
