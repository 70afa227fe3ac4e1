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


@pytest.mark.parametrize("name", list(optim_bench.OPTIMIZERS))
def test_optim_accepts_reprop(name, machine, capsys):
    report = optim_report(name, machine, capsys)
    assert "WARNING" not in report.replace("WARNING: load average", "")
    assert "from the same parameters" in report
