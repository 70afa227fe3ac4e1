"""Benchmark reprop's fused optimizers against torch.optim's foreach and fused paths.

For each optimizer (AdamW, SGD with momentum 0.9, Adagrad by default) and two
parameter sets,

    (a) one tensor of 10M parameters (100M on CUDA): pure streaming bandwidth;
    (b) MobileNetV2's 158 parameter tensors (3.5M parameters): per-tensor overhead,

it times one optimizer step of torch.optim.X(foreach=True), torch.optim.X(fused=True)
(when torch has it for that optimizer and device), reprop.optim.X, and two
bandwidth probes moving the same number of bytes (dst.copy_(src) and the
in-place a.add_(b): the practical limit), all in the same run, alternated, and
reports medians, the speedup peer/reprop (> 1: reprop faster) and reprop's
achieved bandwidth against the probes'.

Gradients are synthetic random tensors set once on p.grad; every candidate
steps its own copy of the same parameters and gradients. lr is 1e-6 so that
hundreds of steps leave the values in range.

Agreement check, separate from the timing: reprop and torch foreach take
CHECK_STEPS steps from identical copies at a realistic lr (CHECK_LR; AdamW's
weight decay 0.01 as timed), each step on its own seeded random gradients,
set alike on both, and every parameter element must match: bitwise for SGD
on the CPU, within CHECK_ULPS fp32 rounding steps elsewhere. At the timed lr
it could not be seen: 1 - lr * weight_decay rounds to 1.0 in fp32, and
rounding differences are as large as a whole update. With the same gradient
at every step it could not be seen either: Adam's bias-corrected moments are
then g and g^2 whatever its betas. A mismatch prints a WARNING, and the run
exits with status 1 once the report is printed and the JSON written.

    python benchmarks/optim.py --quick                     # CI-sized, CPU
    python benchmarks/optim.py --device cuda --json out.json
    python benchmarks/optim.py --only adamw --peers-only   # torch only (no reprop needed)
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Callable

import torch

# Run as a script, benchmarks/ is already on sys.path; as `python -m benchmarks.optim` it is not.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
import models  # noqa: E402

LR = 1e-6


@dataclass(frozen=True)
class OptimSpec:
    """One optimizer under test: its torch.optim / reprop.optim class name, arguments, traffic."""

    cls: str
    kwargs: dict
    bytes_per_param: int  # fp32 bytes read + written per parameter per step
    traffic: str          # how bytes_per_param is counted, printed with the results
    bitwise: bool = False  # reprop's fp32 result is torch's bit for bit on the CPU (README: SGD)


OPTIMIZERS: dict[str, OptimSpec] = {
    "adamw": OptimSpec("AdamW", {"lr": LR, "weight_decay": 0.01}, 28, "read p,g,m,v + write p,m,v = 7 x 4 B"),
    "sgd": OptimSpec("SGD", {"lr": LR, "momentum": 0.9}, 20, "read p,g,buf + write p,buf = 5 x 4 B",
                     bitwise=True),
    "adagrad": OptimSpec("Adagrad", {"lr": LR}, 20, "read p,g,sum + write p,sum = 5 x 4 B"),
    # Not in the default set; available with --only.
    "adam": OptimSpec("Adam", {"lr": LR}, 28, "read p,g,m,v + write p,m,v = 7 x 4 B"),
    "rmsprop": OptimSpec("RMSprop", {"lr": LR}, 20, "read p,g,sq + write p,sq = 5 x 4 B"),
    "adadelta": OptimSpec("Adadelta", {"lr": LR}, 28, "read p,g,sq,acc + write p,sq,acc = 7 x 4 B"),
}
DEFAULT_ONLY = "adamw,sgd,adagrad"

# Candidate names, in table order. The first peer is the reference for the agreement check
# (torch's foreach path exists for every optimizer on every device).
FOREACH, FUSED, REPROP = "torch foreach", "torch fused", "reprop"
PEERS = (FOREACH, FUSED)
PROBES = harness.PROBES  # "copy" and "inplace" bandwidth probes, timed as candidates too

# Targets (printed as PASS/MISS, never asserted): minimum speedup over torch fused, on which
# cases; minimum fraction of the copy bandwidth on the single-tensor case.
TARGETS = {
    "cpu": {"speedup_cases": ("single",), "copy_fraction": 0.80},
    "cuda": {"speedup_cases": ("single", "model"), "copy_fraction": 0.90},
}


# Agreement check (check_agreement): CHECK_STEPS steps at CHECK_LR from identical copies, each on
# its own random gradients (check_gradients). An element may differ from torch foreach's by
# rounding: of the parameter's value (the final p - update) and of its update (terms summed in
# another order, torch's CPU sqrt not correctly rounded), so within CHECK_ULPS x eps x (|p| + that
# tensor's largest update); measured <= 1.8 (RMSprop; AdamW, Adam and Adagrad 1.6, Adadelta
# 1.0) on both parameter sets. A missing AdamW weight decay is off by lr x wd x |p| =
# 1e-5 |p| (20x the bound), a skipped step by a whole update; Adam's beta1 0.8 for 0.9 by 7% of
# lr (the median element; the largest 14%), beta2 0.99 for 0.999 by 0.15% (the largest 0.5%, 10x
# the bound).
CHECK_LR = 1e-3
CHECK_STEPS = 3
CHECK_ULPS = 4
CHECK_SEED = 1  # of the check's gradients (make_inputs' are seed 0's)


@dataclass
class ParamSet:
    """A list of parameter shapes to step: the single big tensor or a model's parameters."""

    kind: str   # "single" or "model"
    label: str
    shapes: list[torch.Size]

    @property
    def numel(self) -> int:
        return sum(s.numel() for s in self.shapes)


@dataclass
class Candidate:
    """A timed callable, the parameters it updates (None for the probes), or why it is n/a."""

    step: Callable[[], object] | None = None
    params: list[torch.Tensor] | None = None
    unavailable: str | None = None


@dataclass
class CaseResult:
    """Everything measured for one (optimizer, parameter set)."""

    optimizer: str
    params: ParamSet
    bytes_per_step: int
    inner: int
    stats: dict[str, harness.Stats] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)
    mismatch: str | None = None  # why reprop's parameters differ from torch foreach's (check_agreement)
    checked: bool = False        # whether check_agreement ran (reprop and torch foreach available)


# ---------------------------------------------------------------------------
# Setup
# ---------------------------------------------------------------------------


def param_sets(single_numel: int) -> list[ParamSet]:
    """(a) one big tensor, (b) MobileNetV2's parameter shapes."""
    mnv2 = [p.shape for p in models.build("mobilenet_v2").parameters()]
    return [
        ParamSet("single", f"1x{single_numel / 1e6:g}M", [torch.Size([single_numel])]),
        ParamSet("model", f"mobilenet_v2 ({len(mnv2)}x)", mnv2),
    ]


def make_inputs(pset: ParamSet, device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Random fp32 initial parameters and gradients (the same for every candidate)."""
    torch.manual_seed(0)
    params = [torch.randn(s, device=device) for s in pset.shapes]
    grads = [torch.randn(s, device=device) for s in pset.shapes]
    return params, grads


def optimizer_factories(spec: OptimSpec, with_reprop: bool,
                        **overrides) -> dict[str, Callable[[list], torch.optim.Optimizer]]:
    """Constructors of the stepped candidates, by candidate name (``overrides`` replace spec.kwargs')."""
    torch_cls = getattr(torch.optim, spec.cls)
    kwargs = spec.kwargs | overrides
    factories = {
        FOREACH: lambda ps: torch_cls(ps, foreach=True, **kwargs),
        FUSED: lambda ps: torch_cls(ps, fused=True, **kwargs),
    }
    if with_reprop:
        import reprop.optim
        factories[REPROP] = lambda ps: getattr(reprop.optim, spec.cls)(ps, **kwargs)
    return factories


def copy_params(init: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    """Own copies of the initial parameters, each with its own copy of its gradient."""
    params = [torch.nn.Parameter(p.clone()) for p in init]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    return params


def make_candidate(factory: Callable[[list], torch.optim.Optimizer], init: list[torch.Tensor],
                   grads: list[torch.Tensor]) -> Candidate:
    """Own copies of params and grads, an optimizer over them, and one probe step.

    The probe step is where torch raises for an unsupported fused/device
    combination (some only at step time), and it creates the optimizer state.
    Every candidate takes it, so all end with the same number of steps.
    """
    params = copy_params(init, grads)
    try:
        opt = factory(params)
        opt.step()
    except Exception as e:  # noqa: BLE001 - any failure means "n/a here", with the reason shown
        return Candidate(unavailable=f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
    return Candidate(step=opt.step, params=params)


def check_gradients(init: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """CHECK_STEPS lists of seeded random gradients for ``init``'s tensors, one list per step.

    The gradient changes from step to step, as in training: with one gradient
    for every step, Adam's bias-corrected moments are g and g^2 whatever its
    betas, so wrong betas passed.
    """
    torch.manual_seed(CHECK_SEED)
    return [[torch.randn_like(p) for p in init] for _ in range(CHECK_STEPS)]


def trained(factory: Callable[[list], torch.optim.Optimizer], init: list[torch.Tensor],
            step_grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The parameters after one step of ``factory``'s optimizer per list of ``step_grads`` (that step's
    gradients, copied onto the parameters before it), from copies of ``init``."""
    params = [torch.nn.Parameter(p.clone()) for p in init]
    opt = factory(params)
    for grads in step_grads:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params]


def compare_updates(spec: OptimSpec, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                    init: dict[str, torch.Tensor], device: torch.device) -> str | None:
    """None when the parameters ``got`` equal ``want`` (both stepped alike from ``init``; by name), else why not.

    Bitwise where reprop is torch's bit for bit (spec.bitwise, on the CPU; on
    CUDA torch's kernels are other code), else within CHECK_ULPS rounding
    steps (see CHECK_ULPS). fusion.py checks its candidates by this rule too.
    """
    if spec.bitwise and device.type == "cpu":
        return harness.check_close(got, want, rtol=0.0, atol=0.0)
    step = CHECK_ULPS * torch.finfo(torch.float32).eps
    atol = {n: step * float((w - init[n].to(w.device)).abs().max()) for n, w in want.items()}
    return harness.check_close(got, want, rtol=step, atol=atol)


def check_agreement(spec: OptimSpec, init: list[torch.Tensor], device: torch.device) -> str | None:
    """None when reprop's parameters equal torch foreach's after CHECK_STEPS steps at CHECK_LR on
    check_gradients, else why not.

    A wrong or skipped update would also be "fast".
    """
    factories = optimizer_factories(spec, with_reprop=True, lr=CHECK_LR)
    step_grads = check_gradients(init)

    def by_name(tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        return {f"param {i}": t for i, t in enumerate(tensors)}

    return compare_updates(spec, by_name(trained(factories[REPROP], init, step_grads)),
                           by_name(trained(factories[FOREACH], init, step_grads)), by_name(init), device)


# ---------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------


def run_case(name: str, spec: OptimSpec, pset: ParamSet, device: torch.device, args,
             with_reprop: bool) -> CaseResult:
    """Build all candidates for one case, time them alternated, check agreement."""
    init, grads = make_inputs(pset, device)
    cands = {n: make_candidate(f, init, grads) for n, f in optimizer_factories(spec, with_reprop).items()}
    bytes_per_step = pset.numel * spec.bytes_per_param
    for kind in PROBES:
        cands[kind] = Candidate(step=harness.make_bandwidth_probe(bytes_per_step, device, kind))

    timed = {n: c.step for n, c in cands.items() if c.step is not None}
    # One shared count (its calibration calls each candidate twice more, alike), so all
    # optimizers take the same number of steps and the agreement check compares like with like.
    inner = harness.choose_inner(list(timed.values()), device, args.min_sample_ms)
    result = CaseResult(name, pset, bytes_per_step, inner)
    result.stats = harness.measure_alternated(timed, device, args.warmup, args.reps, inner)
    result.unavailable = {n: c.unavailable for n, c in cands.items() if c.unavailable}

    checked = REPROP in timed and FOREACH in timed
    del cands, timed  # free the timed buffers before the check's copies
    if checked:
        result.checked = True
        result.mismatch = check_agreement(spec, init, device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


# ---------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------


def median(result: CaseResult, name: str) -> float | None:
    """Median ms of a candidate, None when it was n/a or not run."""
    s = result.stats.get(name)
    return s.median if s else None


def relative_iqr(result: CaseResult, *names: str) -> float:
    """The widest IQR / median among the named candidates: a speedup within ~this of 1 is a tie."""
    return max(result.stats[n].iqr / result.stats[n].median for n in names)


def table_rows(result: CaseResult) -> list[dict]:
    """One row per peer: times, speedup, bandwidths (None where n/a)."""
    ours = median(result, REPROP)

    def bandwidth(name: str) -> float | None:
        ms = median(result, name)
        return harness.gbps(result.bytes_per_step, ms) if ms else None

    rows = []
    for peer in PEERS:
        peer_ms = median(result, peer)
        row = {
            "optimizer": result.optimizer,
            "case": result.params.label,
            "peer": peer,
            "peer_ms": peer_ms,
            "reprop_ms": ours,
            "speedup": harness.speedup(peer_ms, ours) if peer_ms and ours else None,
            "spread": relative_iqr(result, peer, REPROP) if peer_ms and ours else None,
            "peer_gbps": bandwidth(peer),
            "reprop_gbps": bandwidth(REPROP),
            "peer_unavailable": result.unavailable.get(peer),
        }
        for kind in PROBES:
            row[f"{kind}_gbps"] = bandwidth(kind)
            # Same bytes, so the fraction of the probe's bandwidth is a time ratio.
            row[f"reprop_{kind}_fraction"] = median(result, kind) / ours if ours else None
        rows.append(row)
    return rows


def format_rows(rows: list[dict]) -> str:
    """The results table, n/a where a peer is unavailable, - where reprop did not run."""
    headers = ["optimizer case", "peer", "peer ms", "reprop ms", "speedup", "IQR", "reprop GB/s",
               "% copy", "% inplace", "peer GB/s", "copy GB/s", "inplace GB/s"]

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.0f}%"

    out = []
    for r in rows:
        na = "n/a" if r["peer_unavailable"] else "-"

        def peer_cell(value: float | None, spec: str) -> str:
            return harness.fmt(value, spec) if r["peer_ms"] else na

        out.append([
            f"{r['optimizer']} {r['case']}", r["peer"],
            peer_cell(r["peer_ms"], ".3f"),
            harness.fmt(r["reprop_ms"], ".3f"),
            peer_cell(r["speedup"], ".2f"),
            pct(r["spread"]) if r["peer_ms"] else na,
            harness.fmt(r["reprop_gbps"], ".1f"),
            pct(r["reprop_copy_fraction"]),
            pct(r["reprop_inplace_fraction"]),
            peer_cell(r["peer_gbps"], ".1f"),
            harness.fmt(r["copy_gbps"], ".1f"),
            harness.fmt(r["inplace_gbps"], ".1f"),
        ])
    return harness.format_table(headers, out)


def evaluate_targets(results: list[CaseResult], device: torch.device) -> list[dict]:
    """PASS/MISS against this device's targets (see TARGETS); nothing when reprop did not run.

    The speedup target is against torch fused; where torch has no fused path
    for the optimizer/device, against torch foreach (named in the line).
    """
    goal = TARGETS[device.type]
    checks = []
    for res in results:
        ours = median(res, REPROP)
        if ours is None:
            continue
        if res.params.kind in goal["speedup_cases"]:
            peer = FUSED if median(res, FUSED) else FOREACH
            ratio = harness.speedup(median(res, peer), ours)
            spread = relative_iqr(res, peer, REPROP)
            checks.append({"optimizer": res.optimizer, "case": res.params.label,
                           "target": f"reprop >= {peer}", "value": f"speedup {ratio:.2f}, IQR {spread:.0%}",
                           "pass": ratio >= 1.0})
        if res.params.kind == "single":
            frac = median(res, "copy") / ours
            checks.append({"optimizer": res.optimizer, "case": res.params.label,
                           "target": f"reprop >= {goal['copy_fraction']:.0%} of copy GB/s",
                           "value": f"{frac:.0%}", "pass": frac >= goal["copy_fraction"]})
    return checks


def print_report(results: list[CaseResult], specs: dict[str, OptimSpec], checks: list[dict],
                 info: dict, args) -> None:
    """Machine line, the traffic formula, the table, notes on n/a peers, agreement, targets."""
    print(harness.describe_machine(info))
    print(f"device {args.device}; median of {args.reps} rounds (A B C alternated, rotating), "
          f"{args.warmup} warm-up call(s) each; fp32; lr {LR:g}")
    print("GB/s = numel x bytes/param / median step time; bytes/param:")
    for spec in specs.values():
        print(f"  {spec.cls}: {spec.bytes_per_param} ({spec.traffic})")
    print("bandwidth probes with the same counted bytes, timed in the same alternation: "
          "copy = dst.copy_(src) (on CPUs also pays a\n  write-allocate read of dst), "
          "inplace = a.add_(b) (read-only + read-modify-write streams, like an optimizer step)")
    print("speedup = peer ms / reprop ms (> 1: reprop faster); IQR = the wider inter-quartile range "
          "of the two, relative to the median\n")
    rows = [row for res in results for row in table_rows(res)]
    print(format_rows(rows))

    notes = {(r["optimizer"], r["peer"], r["peer_unavailable"]) for r in rows if r["peer_unavailable"]}
    for opt, peer, why in sorted(notes):
        print(f"n/a: {opt} {peer}: {why}")
    for res in results:
        if REPROP in res.unavailable:
            print(f"n/a: {res.optimizer} / {res.params.label} reprop: {res.unavailable[REPROP]}")
    checked = [r for r in results if r.checked]
    if checked:
        bitwise = ", ".join(s.cls for s in specs.values() if s.bitwise) or "none"
        ok = all(r.mismatch is None for r in checked)
        print(f"reprop vs torch foreach after {CHECK_STEPS} steps at lr {CHECK_LR:g} from the same parameters, "
              "each step on its own random gradients, "
              f"element by element (bitwise: {bitwise}, on the CPU; the others within {CHECK_ULPS} x eps x "
              f"(|p| + largest update)): {'ok' if ok else 'WARNING: not the same update, check reprop'}")
    for r in checked:
        if r.mismatch is not None:
            print(f"WARNING: {r.optimizer} / {r.params.label}: {r.mismatch}")
    if checks:
        print("\ntargets:")
        for c in checks:
            print(f"  {'PASS' if c['pass'] else 'MISS'}  {c['optimizer']} / {c['case']}: "
                  f"{c['target']} ({c['value']})")


def json_payload(results: list[CaseResult], checks: list[dict], info: dict, args) -> dict:
    """All settings, every candidate's full statistics, the table rows and the targets."""
    return {
        "benchmark": "optim",
        "machine": info,
        "config": {k: v for k, v in vars(args).items() if k != "json"} | {
            "lr": LR, "check": {"lr": CHECK_LR, "steps": CHECK_STEPS, "ulps": CHECK_ULPS}},
        "cases": [{
            "optimizer": r.optimizer,
            "case": r.params.label,
            "numel": r.params.numel,
            "tensors": len(r.params.shapes),
            "bytes_per_step": r.bytes_per_step,
            "calls_per_sample": r.inner,
            "stats_ms": {n: s.to_dict() for n, s in r.stats.items()},
            "unavailable": r.unavailable,
            "reprop_mismatch": r.mismatch if r.checked else "not checked",
        } for r in results],
        "rows": [row for res in results for row in table_rows(res)],
        "targets": checks,
    }


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------


def parse_args():
    """Shared harness options plus --only, --numel, --peers-only, --min-sample-ms."""
    p = harness.make_parser(__doc__.splitlines()[0])
    p.add_argument("--only", default=DEFAULT_ONLY,
                   help=f"comma-separated optimizers (default {DEFAULT_ONLY}; also: "
                        f"{', '.join(k for k in OPTIMIZERS if k not in DEFAULT_ONLY.split(','))})")
    p.add_argument("--numel", type=int, default=None,
                   help="size of the single-tensor case (default 10M on cpu, 100M on cuda)")
    p.add_argument("--peers-only", action="store_true",
                   help="time torch's optimizers and the probes only (reprop need not be installed)")
    p.add_argument("--min-sample-ms", type=float, default=None,
                   help="repeat calls within a sample until it lasts this long "
                        "(default 1 on cuda, where single steps can be microseconds; 0 on cpu)")
    args = p.parse_args()
    unknown = [o for o in args.only.split(",") if o not in OPTIMIZERS]
    if unknown:
        p.error(f"--only: unknown optimizer(s) {', '.join(unknown)}; known: {', '.join(OPTIMIZERS)}")
    if args.reps is None:
        args.reps = 7 if args.quick else 25
    if args.warmup is None:
        args.warmup = 1 if args.quick else 3
    if args.numel is None:
        args.numel = 100_000_000 if args.device == "cuda" else 10_000_000
    if args.min_sample_ms is None:
        args.min_sample_ms = 1.0 if args.device == "cuda" else 0.0
    return args


def check_reprop(device: torch.device) -> None:
    """Exit with a clear message when reprop (or its CUDA build, for --device cuda) is missing."""
    try:
        import reprop
        import reprop.optim  # noqa: F401
    except Exception as e:  # noqa: BLE001
        raise SystemExit(f"cannot import reprop.optim ({type(e).__name__}: {e}); install it "
                         "(pip install -e .) or pass --peers-only to time torch alone")
    if device.type == "cuda" and not reprop.cuda_available():
        raise SystemExit("reprop.cuda_available() is False: this build has no CUDA kernels "
                         "(built without nvcc or with REPROP_CUDA=0)")


def main() -> None:
    args = parse_args()
    device = harness.setup_device(args)
    with_reprop = not args.peers_only
    if with_reprop:
        check_reprop(device)
    specs = {name: OPTIMIZERS[name] for name in args.only.split(",")}
    info = harness.machine_info(device)

    results = []
    for pset in param_sets(args.numel):
        for name, spec in specs.items():
            print(f"... {name} / {pset.label}", file=sys.stderr, flush=True)
            results.append(run_case(name, spec, pset, device, args, with_reprop))
    results.sort(key=lambda r: list(specs).index(r.optimizer))  # group the table by optimizer

    checks = evaluate_targets(results, device)
    print_report(results, specs, checks, info, args)
    harness.write_json(args.json, json_payload(results, checks, info, args))
    harness.exit_if_failed(any(r.mismatch is not None for r in results))


if __name__ == "__main__":
    main()
