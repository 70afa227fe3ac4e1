"""Benchmark reprop's BPPSA recurrent layers (reprop.bppsa) against torch's nn.RNN / nn.GRU.

Reproduces the paper's end-to-end benchmarks (BPPSA, Sections 4.1-4.2 and 5.1-5.2,
appendix Tables 4-6), the peer and ours in the same run, alternated, medians:

  * RNN, bitstream classification (Eq. 8, reprop.bppsa.bitstream): tanh
    RNN(1, d) + Linear(d, 10) on the last hidden state, cross entropy, Adam
    lr 1e-5 (models.bitstream_rnn).
  * GRU on MFCC-shaped synthetic inputs (standard-normal (F, B, C) features,
    11 classes; models.mfcc_gru / models.mfcc_batch): GRU(C, 20) + Linear(20, 11),
    Adam lr 3e-4; the paper's sets S, M, L are F x C = 259x38, 517x24, 1034x12.

The baseline is the model with torch's nn.RNN / nn.GRU (cuDNN on CUDA); ours is
the same model, built from the same seed (same initial weights, checked), then
reprop.bppsa.convert(model, scan=--scan). Per configuration (T, B, d), on one
batch, all times are medians of --reps rounds of one training iteration each:

  fwd        forward + loss of the baseline model, no backward (graph dropped)
  fwd ours   the same with the converted model (includes any Jacobian work
             ours does in its forward: the paper's "FP + overhead")
  base       forward + backward + Adam step + zero_grad, baseline
  bppsa      the same, converted model
  bwd x      backward speedup, the paper's definition (base - fwd) / (bppsa - fwd), except
             that where ours' forward is faster than the baseline's (fwd ours < fwd, as
             with reprop's CPU forward against torch's CPU nn.RNN) bppsa's own forward
             is subtracted instead: (base - fwd) / (bppsa - min(fwd, fwd ours)), so a
             faster forward is never counted as a faster backward. Equal to the paper's
             formula whenever ours' forward costs at least the baseline's (the paper's
             case: both run cuDNN's forward). "-" when a difference is not positive
             (backward within noise). The JSON also has the literal formula's value.
  bwd x ex   the same excluding ours' forward overhead: (base - fwd) / (bppsa - fwd ours)
             (the paper's GRU figure, Section 5.2)
  e2e x      end-to-end speedup base / bppsa
  V100 ...   the paper's backward and end-to-end speedups for the same T, B (d = 20),
             derived from its V100 Tables 4-6 as bwd x and e2e x are (the JSON also has
             the GRU's excluding-overhead figure, from Table 6's "FP + Overhead" row)
  MiB        peak memory of one steady-state iteration (harness.peak_memory: model,
             Adam state, one warm-up step, then the measured step; CUDA counters or,
             on CPU, the profiler's allocation events)
  grad err   max over parameters of max |g_ours - g_base| / max |g_base|: one
             backward of each from the same initial weights on the same batch
  levels     the up-sweep levels ours runs / max_levels(T) (with --scan auto, what
             reprop.bppsa.scan_levels' cost model picks)

Sweeps (--part, repeatable; default all):

  rnn-t       T in 10, 30, 100, ..., 30000 at B = --batch (16), d = --hidden (20)
  rnn-batch   B in 2, 4, ..., 256 at T = --seq-len (1000), d = --hidden
  rnn-hidden  d in 8, 16, 20, 32, 64, 128 at T = --seq-len, B = --batch: where the
              scan's d^2 matrix products stop paying
  gru         sets S, M, L x B in 16, 32, 64 (d = 20)
  graph       T = --seq-len, B = --batch, d = --hidden with every call a CUDA graph's replay
              (reprop.ooo.capture, Adam capturable), on both sides: the GPU's share of the
              comparison, without the host's cost of issuing the kernels (CUDA only)
  scan        the scan alone, as the RNN's backward calls it (tanh, pre_activation) at T = --seq-len,
              B = --batch, d = --hidden, at every levels (the cost model's pick marked), alternated;
              on CUDA also each kernel's GPU time at the pick (torch.profiler): what a level costs
  vgg         the pruned VGG-11 micro-benchmark (Sections 4.3 and 5.3), on --device: VGG-11's
              layers (config A: 3x3 Conv2d pad 1 + ReLU, 2x2 MaxPool2d; then Flatten and the
              CIFAR classifier Linear 512-512-10 unless --vgg-features-only) as one chain on
              --vgg-res (32, CIFAR-10) inputs, channels / --vgg-width-div. One ChainPlan per
              --vgg-levels (default 0 and 3: the linear scan and the paper's up-sweep L0-L2),
              built once; then per --vgg-sparsities (0, 0.5, 0.9, 0.97, the paper's 97%) the
              same modules are pruned in place by magnitude, per layer (the plans see the new
              weights as in retraining), and reprop.bppsa.chain_backward (the input's
              gradient through the CSR transposed Jacobians, values gathered every call) is
              timed against torch.autograd.grad(model(x), x, g), alternated, each with its
              forward. "chain" rows use ChainPlan's default patterns, from the layers'
              geometry only: pruned weights stay in them as explicit zeros, so nnz and scan
              MACs (ChainPlan.info madds) do not fall with pruning. "masked" rows plan the
              pruned chain with ChainPlan(pruned=True), which leaves the zero weights'
              entries out (what the paper counts). On CUDA the masked plans are also run by the
              cuSPARSE peer, ChainPlan(pruned=True, product="cusparse"), in the same alternated
              rounds ("vs cusparse" = cusparse / masked); on the CPU, or in a build without the
              peer, that column is "-" and the reason is printed. Also printed: every layer's J^T size, nnz and
              density, and the dense autograd input-gradient's MACs (conv backward-data
              c_in c_out 9 h w, Linear in x out) plus element ops (ReLU, pool scatter).

Correctness: a WARNING is printed for a configuration whose converted model's weights
differ from the baseline's or whose grad err is beyond GRAD_TOLERANCE (1e-5), and for a vgg
row whose input gradient error (err, masked err, cusparse err: max |dx - dx_autograd| /
max |dx_autograd|) is beyond it; the run then exits with status 1, once every table is
printed and the JSON written.

Configurations repeated across sweeps (e.g. T=1000, B=16, d=20) are measured once.
On CUDA a configuration whose estimated memory (estimate_bytes) exceeds
--mem-cap-gib is skipped with a note, as is one that runs out of memory.

Summary: at T=1000, B=16, d=20 the backward and end-to-end speedups against the
issue's H200 targets (backward >= 20x over cuDNN, the paper's 16x on an RTX 2070;
end-to-end >= 2.75x), and the best backward speedup of the run against the
paper's 108x (RTX 2080Ti). PASS/MISS on CUDA only; on CPU for information.

--quick: a CI-sized CPU run: T in 10, 100, 1000; B in 2, 8 and d in 8, 32 at T = 100;
GRU set S at B = 16; 3 rounds, 1 warm-up (11-15 s on 2 CPUs with --threads 1 even with
other jobs running; two OpenMP threads on a busy 2-CPU box can take minutes, see the
harness's load warning). About half of it is the CPU peak-memory profiling. The vgg
part's quick run is VGG-11 at 1/16 width (4 to 32 channels), batch 4 (about 30 s); the
full run 1/8 width (the unpruned 3-level plan alone holds ~3.5 GB of product patterns;
at full width it would not fit: use --vgg-width-div 1 --vgg-levels 0 there).

    python benchmarks/bppsa.py --quick
    python benchmarks/bppsa.py --device cuda --json $OUT/bppsa-cuda.json
    python benchmarks/bppsa.py --device cuda --part rnn-t --scan blelloch
    python benchmarks/bppsa.py --device cuda --part rnn-hidden --hiddens 20,256 --seq-len 3000
    python benchmarks/bppsa.py --quick --part vgg
    python benchmarks/bppsa.py --part vgg --vgg-width-div 1 --vgg-levels 0
"""

from __future__ import annotations

import functools
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

# Run as a script, benchmarks/ is already on sys.path; as `python -m benchmarks.bppsa` it is not.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
import models  # noqa: E402

LR = {"rnn": 1e-5, "gru": 3e-4}  # the paper's Adam learning rates (Sections 4.1, 4.2)
GATES = {"rnn": 1, "gru": 3}     # gate blocks per step, as reprop.bppsa.scan_levels takes them
DATA_SEED = 0
MODEL_SEED = 0
MIB = 2**20
GIB = 2**30

RNN_PARTS = ("rnn-t", "rnn-batch", "rnn-hidden", "gru")
PARTS = RNN_PARTS + ("vgg", "graph", "scan")
SCANS = ("auto", "blelloch", "linear")
FULL = {"seq_lens": (10, 30, 100, 300, 1000, 3000, 10000, 30000),
        "batches": (2, 4, 8, 16, 32, 64, 128, 256),
        "hiddens": (8, 16, 20, 32, 64, 128),
        "gru_sets": ("S", "M", "L"), "gru_batches": (16, 32, 64),
        "seq_len": 1000, "reps": 10, "warmup": 2}
QUICK = {"seq_lens": (10, 100, 1000), "batches": (2, 8), "hiddens": (8, 32),
         "gru_sets": ("S",), "gru_batches": (16,),
         "seq_len": 100, "reps": 3, "warmup": 1}

# The summary's reference configuration and targets (printed as PASS/MISS on CUDA, never asserted).
REFERENCE = {"seq_len": 1000, "batch": 16, "hidden": 20}
TARGET_BACKWARD = 20.0    # the H200 target over cuDNN (paper: 16x on an RTX 2070)
TARGET_END_TO_END = 2.75  # the H200 target (paper: 2.73x on an RTX 2070 at this config)
PAPER_BEST_BACKWARD = 108.0  # the paper's best backward speedup (RTX 2080Ti, Section 5.1)

# Correctness: ours' gradients (RNN/GRU: every parameter's against the baseline model's; vgg: the
# input's against autograd's), max |g - g_ref| / max |g_ref|. Both sides are fp32 sums of the same
# terms in other orders (on CUDA the reference without TF32, harness.reproducible): measured at most
# 6.2e-7 over the full RNN/GRU sweeps (CPU; RESULTS.md's --quick rows 2.1e-7 to 3.4e-7) and 7.5e-7
# on the vgg chain (1/16 to 1/4 width). A wrong gradient is off by O(1) (a negated one by 2).
GRAD_TOLERANCE = 1e-5

# Rough memory model for the CUDA cap (bytes per float32 element, see estimate_bytes).
JACOBIAN_COPIES = 3  # the T transposed Jacobians (d x d per sample) plus the scan's partial products
STATE_COPIES = 8     # per gate block: activations, gates, gradients of both models

# ---------------------------------------------------------------------------
# The paper's figures (appendix G, V100; seconds per epoch)
# ---------------------------------------------------------------------------

# Table 4, B = 16: T -> (forward only, baseline, BPPSA).
PAPER_T = {10: (1.57, 4.49, 4.24), 30: (2.13, 5.5, 4.91), 100: (3.82, 8.87, 6.64),
           300: (8.79, 18.49, 11.71), 1000: (25.86, 53.33, 29.29), 3000: (75.33, 157.11, 79.48),
           10000: (250.28, 510.13, 265.02), 30000: (748.99, 1557.94, 764.31)}
# Table 5, T = 1000: B -> (forward only, baseline, BPPSA).
PAPER_B = {256: (2.13, 4.02, 3.72), 128: (3.87, 7.96, 5.49), 64: (7.51, 14.77, 9.27),
           32: (13.62, 29.51, 15.0), 16: (25.86, 53.33, 29.29), 8: (51.29, 102.77, 56.37),
           4: (100.55, 209.67, 112.23), 2: (200.65, 409.33, 227.13)}
# Table 6: (set, B) -> (FP, baseline, FP + overhead, BPPSA).
PAPER_GRU = {("S", 16): (1.66, 3.71, 2.1, 2.94), ("S", 32): (0.91, 1.9, 1.09, 1.48),
             ("S", 64): (0.52, 1.0, 0.62, 0.82), ("M", 16): (3.21, 6.19, 3.52, 4.2),
             ("M", 32): (1.73, 3.3, 1.83, 2.22), ("M", 64): (0.86, 1.82, 1.18, 1.2),
             ("L", 16): (5.78, 11.43, 6.06, 6.91), ("L", 32): (3.04, 6.09, 3.23, 3.57),
             ("L", 64): (1.64, 3.19, 2.13, 2.33)}

# Candidate names (timed in one alternation).
FWD, FWD_OURS, BASE, OURS = "fwd", "fwd ours", "base", "bppsa"


# ---------------------------------------------------------------------------
# Configurations
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """One measured configuration: cell type, sequence length, batch, hidden size, inputs."""

    cell: str         # "rnn" or "gru"
    seq_len: int      # T (GRU: frames F)
    batch: int        # B
    hidden: int       # d
    inputs: int = 1   # input features per step (GRU: MFCC coefficients C)
    dataset: str = "bitstream"  # "bitstream", or the GRU's MFCC set name (S, M, L)

    @property
    def label(self) -> str:
        if self.cell == "gru":
            return f"{self.dataset} {self.seq_len}x{self.inputs} B={self.batch} d={self.hidden}"
        return f"T={self.seq_len} B={self.batch} d={self.hidden}"


def rnn_config(seq_len: int, batch: int, hidden: int) -> Config:
    return Config("rnn", seq_len, batch, hidden)


def gru_config(dataset: str, batch: int) -> Config:
    frames, coefficients = models.MFCC_SHAPES[dataset]
    return Config("gru", frames, batch, 20, coefficients, dataset)


def plan(args) -> list[tuple[str, list[Config]]]:
    """The selected sweeps, in PARTS order: (part, its configurations)."""
    sweeps = {
        "rnn-t": [rnn_config(t, args.batch, args.hidden) for t in args.seq_lens],
        "rnn-batch": [rnn_config(args.seq_len, b, args.hidden) for b in args.batches],
        "rnn-hidden": [rnn_config(args.seq_len, args.batch, d) for d in args.hiddens],
        "gru": [gru_config(s, b) for s in args.gru_sets for b in args.gru_batches],
    }
    return [(part, sweeps[part]) for part in RNN_PARTS if part in args.part]


# ---------------------------------------------------------------------------
# The paper's speedups
# ---------------------------------------------------------------------------


def backward_speedup(base: float, ours: float, fwd: float, fwd_ours: float | None = None) -> float | None:
    """(base - fwd) / (ours - fwd_ours), fwd_ours defaulting to fwd; None unless both are positive."""
    peer_bwd = base - fwd
    our_bwd = ours - (fwd if fwd_ours is None else fwd_ours)
    return peer_bwd / our_bwd if peer_bwd > 0 and our_bwd > 0 else None


def paper_speedups(cfg: Config) -> dict[str, float | None]:
    """The paper's V100 speedups for ``cfg`` (all None where it has none), defined as ours are.

    "bwd": (baseline - FP) / (BPPSA - FP), "bwd_ex": the same less BPPSA's forward
    overhead (GRU only: Table 6's "FP + Overhead"; the RNN tables have no such
    column), "e2e": baseline / BPPSA.
    """
    out = {"bwd": None, "bwd_ex": None, "e2e": None}
    if cfg.hidden != 20:
        return out
    if cfg.cell == "gru":
        row = PAPER_GRU.get((cfg.dataset, cfg.batch))
        if row is None:
            return out
        fp, base, fp_overhead, ours = row
        out["bwd_ex"] = backward_speedup(base, ours, fp, fp_overhead)
    elif cfg.batch == 16 and cfg.seq_len in PAPER_T:
        fp, base, ours = PAPER_T[cfg.seq_len]
    elif cfg.seq_len == 1000 and cfg.batch in PAPER_B:
        fp, base, ours = PAPER_B[cfg.batch]
    else:
        return out
    out["bwd"], out["e2e"] = backward_speedup(base, ours, fp), base / ours
    return out


# ---------------------------------------------------------------------------
# Models, data, trainers
# ---------------------------------------------------------------------------


def reprop_bppsa():
    """reprop.bppsa, imported on first use."""
    import reprop.bppsa
    return reprop.bppsa


def build_model(cfg: Config) -> nn.Module:
    """The configuration's model with torch's recurrent module, seeded: every build starts alike."""
    torch.manual_seed(MODEL_SEED)
    if cfg.cell == "gru":
        return models.mfcc_gru(cfg.inputs, cfg.hidden)
    return models.bitstream_rnn(cfg.hidden)


def make_data(cfg: Config, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch: (T, B, C) float32 inputs and (B,) labels."""
    if cfg.cell == "gru":
        return models.mfcc_batch(cfg.seq_len, cfg.inputs, cfg.batch, device, seed=DATA_SEED)
    g = torch.Generator().manual_seed(DATA_SEED)
    x, y = reprop_bppsa().bitstream(cfg.batch, cfg.seq_len, generator=g)
    return x.to(device), y.to(device)


@dataclass
class Trainer:
    """One model with its Adam optimizer; ``converted`` names the modules reprop swapped."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    converted: list[str] = field(default_factory=list)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.model(x), y)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Forward + loss as in training (the graph is built, then dropped): the paper's "forward pass only"."""
        self.loss(x, y)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """One training iteration: forward, backward, Adam step, gradients freed."""
        self.loss(x, y).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def gradients(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        """The parameters' gradients of one backward on (x, y), without a step; grads left freed."""
        self.optimizer.zero_grad(set_to_none=True)
        self.loss(x, y).backward()
        grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}
        self.optimizer.zero_grad(set_to_none=True)
        return grads


def make_trainer(cfg: Config, device: torch.device, scan: str | int | None = None,
                 capturable: bool = False) -> Trainer:
    """A fresh baseline model (scan None) or a converted one (reprop.bppsa.convert(model, scan)),
    with Adam's capturable update where a CUDA graph is to hold it."""
    model = build_model(cfg)
    converted = []
    if scan is not None:
        converted = reprop_bppsa().convert(model, scan=scan)
        if not converted:
            raise RuntimeError("reprop.bppsa.convert swapped no module")
    model = model.to(device).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR[cfg.cell], capturable=capturable)
    return Trainer(model, optimizer, list(converted))


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    """Whether two models hold the same parameters under the same names."""
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return pa.keys() == pb.keys() and all(torch.equal(pa[n].detach(), pb[n].detach()) for n in pa)


def gradient_error(base: dict[str, torch.Tensor], ours: dict[str, torch.Tensor]) -> float:
    """max over parameters of max |g_ours - g_base| / max |g_base| (inf for a gradient ours lacks
    or a NaN, which max() would drop)."""
    if any(name not in ours for name in base):
        return float("inf")
    return max((harness.relative_error(ours[name], g) for name, g in base.items()), default=0.0)


# ---------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------


@dataclass
class Result:
    """Everything measured for one configuration."""

    cfg: Config
    scan: str | int = "auto"
    levels: int | None = None
    max_levels: int | None = None
    stats: dict[str, harness.Stats] = field(default_factory=dict)
    peaks: dict[str, int | None] = field(default_factory=dict)
    grad_err: float | None = None
    converted: list[str] = field(default_factory=list)
    same_weights: bool | None = None
    inner: int = 1
    unavailable: dict[str, str] = field(default_factory=dict)  # candidate -> why it is n/a
    skipped: str | None = None                                  # why the configuration did not run

    def median(self, name: str) -> float | None:
        s = self.stats.get(name)
        return s.median if s else None


def describe_error(e: BaseException) -> str:
    """``Type: first line of the message`` (shortened), for n/a reasons."""
    text = str(e).splitlines()[0][:140] if str(e) else ""
    return f"{type(e).__name__}: {text}"


def scan_levels(cfg: Config, scan: str | int, device: torch.device) -> tuple[int | None, int | None]:
    """(levels ours runs for ``cfg`` under ``scan``, max_levels(T)); None where reprop cannot say."""
    try:
        bppsa = reprop_bppsa()
        top = int(bppsa.max_levels(cfg.seq_len))
        if scan == "auto":
            return int(bppsa.scan_levels(cfg.seq_len, cfg.batch, cfg.hidden, GATES[cfg.cell], device)), top
        return {"blelloch": top, "linear": 0}.get(scan, scan), top
    except Exception:  # noqa: BLE001 - reporting only
        return None, None


def estimate_bytes(cfg: Config) -> int:
    """A rough upper estimate of one iteration's memory with ours, for the CUDA cap.

    T x B x (JACOBIAN_COPIES d^2 + STATE_COPIES gates d + inputs) float32 elements:
    the transposed Jacobians (one d x d per step and sample) and the scan's
    partial products dominate; the recurrent states, gates and gradients of both
    models and the inputs are linear in d.
    """
    d = cfg.hidden
    per_step = JACOBIAN_COPIES * d * d + STATE_COPIES * GATES[cfg.cell] * d + cfg.inputs
    return 4 * cfg.seq_len * cfg.batch * per_step


def over_cap(cfg: Config, device: torch.device, cap_gib: float) -> str | None:
    """On CUDA, why ``cfg`` is skipped for the memory cap (None when it fits or on the CPU)."""
    if device.type != "cuda" or cap_gib <= 0:
        return None
    need = estimate_bytes(cfg)
    if need <= cap_gib * GIB:
        return None
    return f"estimated {need / GIB:.1f} GiB > --mem-cap-gib {cap_gib:g}"


def step_peak(make: Callable[[], Trainer], x: torch.Tensor, y: torch.Tensor, device: torch.device) -> int | None:
    """Peak bytes of one steady-state iteration: a fresh trainer and one warm-up step, then the measured step."""
    box: list[Trainer] = []

    def setup() -> None:
        box.append(make())
        box[0].step(x, y)

    return harness.peak_memory(lambda: box[0].step(x, y), device, setup)


def check_ours(res: Result, base: Trainer, cfg: Config, x, y, device, args) -> Trainer | None:
    """Build ours, check its weights and gradients against the baseline's; None (reason recorded) if n/a."""
    try:
        ours = make_trainer(cfg, device, args.scan)
        res.converted = ours.converted
        res.same_weights = same_weights(base.model, ours.model)
        with harness.reproducible():  # cuDNN's RNN without TF32: an fp32 reference (GRAD_TOLERANCE)
            res.grad_err = gradient_error(base.gradients(x, y), ours.gradients(x, y))
        return ours
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - ours n/a here, with the reason shown
        res.unavailable[OURS] = res.unavailable[FWD_OURS] = describe_error(e)
        return None


def measure_peaks(res: Result, cfg: Config, x, y, device, with_ours: bool, args) -> None:
    """Peak memory of a baseline and (when available) an ours iteration, one trainer alive at a time."""
    res.peaks[BASE] = step_peak(lambda: make_trainer(cfg, device), x, y, device)
    if with_ours:
        try:
            res.peaks[OURS] = step_peak(lambda: make_trainer(cfg, device, args.scan), x, y, device)
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001
            res.unavailable.setdefault(OURS, describe_error(e))
    harness.release(device)


def measure_times(res: Result, base: Trainer, ours: Trainer | None, x, y, device, args) -> None:
    """Forward-only and training-iteration times of both models, alternated (harness)."""
    candidates = {FWD: lambda: base.forward(x, y), BASE: lambda: base.step(x, y)}
    if ours is not None:
        candidates[FWD_OURS] = lambda: ours.forward(x, y)
        candidates[OURS] = lambda: ours.step(x, y)
    res.inner = harness.choose_inner(list(candidates.values()), device, args.min_sample_ms)
    res.stats = harness.measure_alternated(candidates, device, args.warmup, args.reps, res.inner)


def run_config(cfg: Config, device: torch.device, args) -> Result:
    """Levels, memory cap, gradient check, peaks and times for one configuration."""
    res = Result(cfg, args.scan)
    res.levels, res.max_levels = scan_levels(cfg, args.scan, device)
    res.skipped = over_cap(cfg, device, args.mem_cap_gib)
    if res.skipped:
        return res
    base = ours = None
    try:
        x, y = make_data(cfg, device)
        base = make_trainer(cfg, device)
        ours = check_ours(res, base, cfg, x, y, device, args)
        # Peaks count only what their own fresh trainers allocate, so base and ours may stay alive.
        measure_peaks(res, cfg, x, y, device, ours is not None, args)
        measure_times(res, base, ours if OURS not in res.unavailable else None, x, y, device, args)
    except torch.cuda.OutOfMemoryError as e:
        res.skipped = f"out of memory ({describe_error(e)[:80]})"
    finally:
        del base, ours
        harness.release(device)
    return res


def run_sweep(part: str, configs: list[Config], results: dict[Config, Result], device: torch.device,
              args) -> None:
    """Measures the sweep's configurations into ``results``, those an earlier sweep measured excepted."""
    for cfg in configs:
        if cfg in results:
            continue
        print(f"... {part} {cfg.label}", file=sys.stderr, flush=True)
        results[cfg] = run_config(cfg, device, args)
        if results[cfg].skipped:
            print(f"skip {part} {cfg.label}: {results[cfg].skipped}", flush=True)


def run_sweeps(sweeps: list[tuple[str, list[Config]]], info: dict, device: torch.device,
               args) -> tuple[dict, bool]:
    """Runs the sweeps in turn, each configuration once; returns the JSON payload and whether
    a correctness check failed.

    Each sweep's table is printed, and the JSON so far written, as soon as the
    sweep ends: a later part that fails (an exception, a killed run) loses
    none of the tables before it. Then the notes and the summary.
    """
    print_settings(device, args)
    results: dict[Config, Result] = {}
    table: list[tuple[str, list[tuple[dict, str]]]] = []
    for part, configs in sweeps:
        run_sweep(part, configs, results, device, args)
        rows = [(result_row(part, results[cfg]), cfg.label) for cfg in configs]
        table.append((part, rows))
        print(f"\n{part}\n" + format_sweep(rows), flush=True)
        harness.write_json(args.json, json_payload(table, results, [], info, args))
    checks = summary_checks(results, device)
    print_notes(results)
    problems = [p for res in results.values() for p in result_problems(res)]
    harness.print_check(f"converted models' weights the baseline's, their gradients within {GRAD_TOLERANCE:g} "
                        "(grad err)", problems)
    print_checks(checks, device)
    payload = json_payload(table, results, checks, info, args)
    harness.write_json(args.json, payload)
    return payload, bool(problems)


# ---------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------


def result_row(part: str, res: Result) -> dict:
    """One table/JSON row: times (ms), speedups, the paper's, peaks, gradient error, levels."""
    cfg = res.cfg
    fwd, fwd_ours, base, ours = (res.median(n) for n in (FWD, FWD_OURS, BASE, OURS))
    paper = paper_speedups(cfg)
    timed = fwd is not None and base is not None and ours is not None
    return {
        "part": part, "cell": cfg.cell, "dataset": cfg.dataset, "seq_len": cfg.seq_len, "batch": cfg.batch,
        "hidden": cfg.hidden, "inputs": cfg.inputs, "scan": res.scan,
        "levels": res.levels, "max_levels": res.max_levels,
        "fwd_ms": fwd, "fwd_ours_ms": fwd_ours, "base_ms": base, "bppsa_ms": ours,
        "bwd_speedup": (backward_speedup(base, ours, fwd, min(fwd, fwd_ours if fwd_ours is not None else fwd))
                        if timed else None),
        "bwd_speedup_baseline_fwd": backward_speedup(base, ours, fwd) if timed else None,
        "bwd_speedup_excl_overhead": (backward_speedup(base, ours, fwd, fwd_ours)
                                      if timed and fwd_ours is not None else None),
        "e2e_speedup": harness.speedup(base, ours) if base and ours else None,
        "paper_v100_bwd_speedup": paper["bwd"], "paper_v100_bwd_speedup_excl_overhead": paper["bwd_ex"],
        "paper_v100_e2e_speedup": paper["e2e"],
        "peak_base_bytes": res.peaks.get(BASE), "peak_bppsa_bytes": res.peaks.get(OURS),
        "grad_err": res.grad_err, "same_weights": res.same_weights, "converted": res.converted,
        "unavailable": res.unavailable, "skipped": res.skipped,
    }


TABLE_HEADERS = ["config", "levels", "fwd ms", "fwd ours", "base ms", "bppsa ms", "bwd x", "bwd x ex",
                 "e2e x", "V100 bwd", "V100 e2e", "base MiB", "ours MiB", "grad err"]


def levels_cell(row: dict) -> str:
    if row["levels"] is None:
        return "-"
    return f"{row['levels']}/{row['max_levels']}" if row["max_levels"] is not None else str(row["levels"])


def mib_cell(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / MIB:.3g}"


def table_cells(row: dict, label: str) -> list[str]:
    """One printed row: skipped configurations say why, n/a candidates show '-'."""
    if row["skipped"]:
        return [label, levels_cell(row), f"skipped: {row['skipped']}"] + [""] * (len(TABLE_HEADERS) - 3)
    f = harness.fmt
    return [label, levels_cell(row), f(row["fwd_ms"], ".3g"), f(row["fwd_ours_ms"], ".3g"),
            f(row["base_ms"], ".3g"), f(row["bppsa_ms"], ".3g"), f(row["bwd_speedup"], ".2f"),
            f(row["bwd_speedup_excl_overhead"], ".2f"), f(row["e2e_speedup"], ".2f"),
            f(row["paper_v100_bwd_speedup"], ".2f"), f(row["paper_v100_e2e_speedup"], ".2f"),
            mib_cell(row["peak_base_bytes"]), mib_cell(row["peak_bppsa_bytes"]), f(row["grad_err"], ".1e")]


def format_sweep(rows: list[tuple[dict, str]]) -> str:
    return harness.format_table(TABLE_HEADERS, [table_cells(row, label) for row, label in rows])


def check(target: str, where: str, value: float | None, goal: float, judged: bool, missing: str) -> dict:
    """One target line: value >= goal; pass is None when not judged (CPU) or there is no value (``missing`` says why)."""
    return {"target": target, "case": where, "value": value, "missing": None if value is not None else missing,
            "pass": None if value is None or not judged else bool(value >= goal)}


def missing_reason(res: Result | None) -> str:
    """Why the reference configuration has no speedup: not run, skipped, ours n/a, or a backward within noise."""
    if res is None:
        return "not measured in this run"
    if res.skipped:
        return f"skipped ({res.skipped})"
    if OURS in res.unavailable:
        return f"bppsa n/a ({res.unavailable[OURS]})"
    return "n/a: a forward-subtracted time is not positive (backward within the timing noise)"


def summary_checks(results: dict[Config, Result], device: torch.device) -> list[dict]:
    """The reference configuration's speedups against the issue's targets, the best against the paper's 108x.

    Judged (pass True/False) on CUDA only: the targets are for the H200.
    """
    judged = device.type == "cuda"
    ref = rnn_config(REFERENCE["seq_len"], REFERENCE["batch"], REFERENCE["hidden"])
    row = result_row("summary", results[ref]) if ref in results else None
    where, missing = ref.label, missing_reason(results.get(ref))
    bwd = row["bwd_speedup"] if row else None
    e2e = row["e2e_speedup"] if row else None
    best_row, best = None, None
    for res in results.values():
        value = result_row("best", res)["bwd_speedup"]
        if value is not None and (best is None or value > best):
            best_row, best = res.cfg.label, value
    return [
        check(f"backward >= {TARGET_BACKWARD:g}x over the baseline (H200; paper 16x on RTX 2070)",
              where, bwd, TARGET_BACKWARD, judged, missing),
        check(f"end-to-end >= {TARGET_END_TO_END:g}x (H200; paper 2.73x on RTX 2070)", where, e2e,
              TARGET_END_TO_END, judged, missing),
        check(f"best backward speedup vs the paper's {PAPER_BEST_BACKWARD:g}x (RTX 2080Ti)",
              best_row or "-", best, PAPER_BEST_BACKWARD, judged, "no backward speedup measured"),
    ]


def print_checks(checks: list[dict], device: torch.device) -> None:
    """PASS/MISS on CUDA; on the CPU the values only (the targets are for the H200)."""
    cuda = device.type == "cuda"
    print("\nsummary" + ("" if cuda else " (the targets are for the H200 with CUDA; CPU values for information only)")
          + ":")
    for c in checks:
        value = c["missing"] if c["value"] is None else f"{c['value']:.2f}x"
        verdict = "----" if c["pass"] is None else ("PASS" if c["pass"] else "MISS")
        print(f"  {verdict}  {c['case']}: {c['target']}: {value}")


def print_notes(results: dict[Config, Result]) -> None:
    """n/a reasons, grouped."""
    reasons: dict[str, list[str]] = {}
    for res in results.values():
        if OURS in res.unavailable:
            reasons.setdefault(res.unavailable[OURS], []).append(res.cfg.label)
    for why, where in reasons.items():
        print(f"n/a: bppsa: {why}: {', '.join(where)}")


def result_problems(res: Result) -> list[str]:
    """What is wrong with a configuration's converted model: weights that convert changed, gradients
    beyond GRAD_TOLERANCE from the baseline's (nothing when ours is n/a there)."""
    problems = []
    if res.same_weights is False:
        problems.append(f"{res.cfg.label}: the converted model's weights differ from the baseline's")
    if not harness.within(res.grad_err, GRAD_TOLERANCE):
        problems.append(f"{res.cfg.label}: gradient error {res.grad_err:.2g} vs the baseline, beyond "
                        f"{GRAD_TOLERANCE:g} (wrong gradients?)")
    return problems


def print_settings(device: torch.device, args) -> None:
    """What the sweeps' tables show and how they were measured."""
    print(f"scan={args.scan}; {args.reps} rounds ({args.warmup} warm-ups, {args.min_sample_ms:g} ms min sample), "
          "medians in ms per training iteration (forward + loss [+ backward + Adam step]); "
          "bwd x = (base - fwd) / (bppsa - min(fwd, fwd ours)), bwd x ex = (base - fwd) / (bppsa - fwd ours), e2e x = base / bppsa; "
          "V100 = the paper's Tables 4-6; MiB = peak of one iteration "
          f"({'CUDA counters' if device.type == 'cuda' else 'CPU: profiler allocation events'}); "
          "grad err = max over parameters of max|g_ours - g_base| / max|g_base|; levels = chosen / max",
          flush=True)


def json_payload(table: list, results: dict[Config, Result], checks: list[dict], info: dict, args) -> dict:
    return {
        "benchmark": "bppsa",
        "machine": info,
        "config": {k: v for k, v in vars(args).items() if k != "json"} | {
            "lr": LR, "grad_tolerance": GRAD_TOLERANCE},
        "rows": [row for _, rows in table for row, _ in rows],
        "stats_ms": [{"config": res.cfg.label, "calls_per_sample": res.inner,
                      "stats": {n: s.to_dict() for n, s in res.stats.items()}} for res in results.values()],
        "targets": checks,
    }


# ---------------------------------------------------------------------------
# The pruned VGG-11 chain (Section 4.3)
# ---------------------------------------------------------------------------

# VGG-11, configuration "A": output channels of each 3x3 conv (padding 1, each followed by a
# ReLU), "M" a 2x2 max pool. No batch norm (the paper's Jacobians are of Conv2d, ReLU and
# MaxPool2d); the CIFAR classifier Linear(512, 512), ReLU, Linear(512, 512), ReLU,
# Linear(512, 10) after the features' 512 x 1 x 1 output (dropout is the identity here).
VGG11_CONFIG: list[int | str] = [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"]
VGG_CLASSES = 10  # CIFAR-10
PAPER_SPARSITY = 0.97  # "pruning away 97% of the weights in all convolution and linear operators"
PAPER_LEVELS = 3       # Section 5.3: up-sweep L0-L2, then a linear scan, then the down-sweep
VGG_FULL = {"vgg_width_div": 8, "vgg_batch": 4, "vgg_sparsities": (0.0, 0.5, 0.9, PAPER_SPARSITY),
            "vgg_levels": (0, PAPER_LEVELS)}
VGG_QUICK = {"vgg_width_div": 16, "vgg_batch": 4, "vgg_sparsities": (0.0, 0.5, 0.9, PAPER_SPARSITY),
             "vgg_levels": (0, PAPER_LEVELS)}
VGG_SEED = 0

# Candidate names of the VGG part (timed in one alternation per sparsity).
V_FWD, V_AUTOGRAD = "fwd", "autograd"


def vgg_chain_name(kind: str, levels: int) -> str:
    """Candidate name of a chain_backward run: kind "chain" (ChainPlan's own patterns), "masked"
    or "cusparse" (the masked plan run by the cuSPARSE peer)."""
    return f"{kind} L{levels}"


def cusparse_plans(bppsa, layers: list[nn.Module], in_shape: tuple, args,
                   device: torch.device) -> tuple[dict, str | None]:
    """The cuSPARSE peer's plans per --vgg-levels (pruned=True, as the masked rows'), or
    why there are none: CUDA only, and reprop must have been built with cusparse.h."""
    if device.type != "cuda":
        return {}, "the cuSPARSE peer runs on CUDA tensors only"
    try:
        return {levels: bppsa.ChainPlan(layers, in_shape, levels=levels, max_pairs=args.vgg_max_pairs,
                                        pruned=True, product="cusparse")
                for levels in args.vgg_levels}, None
    except RuntimeError as e:  # not built with the peer
        return {}, describe_error(e)


def vgg11_chain(width_div: int, resolution: int, classifier: bool) -> list[nn.Module]:
    """VGG-11's layers as a flat chain for (3, resolution, resolution) inputs, channels // width_div, seeded."""
    torch.manual_seed(MODEL_SEED)
    layers: list[nn.Module] = []
    channels, size = 3, resolution
    for v in VGG11_CONFIG:
        if v == "M":
            layers.append(nn.MaxPool2d(2, 2))
            size //= 2
        else:
            out = max(1, v // width_div)
            layers += [nn.Conv2d(channels, out, 3, padding=1), nn.ReLU()]
            channels = out
    if classifier:
        hidden = max(1, 512 // width_div)
        layers += [nn.Flatten(), nn.Linear(channels * size * size, hidden), nn.ReLU(),
                   nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, VGG_CLASSES)]
    return layers


def weighted(layers: list[nn.Module]) -> list[nn.Module]:
    return [m for m in layers if isinstance(m, (nn.Conv2d, nn.Linear))]


def prune_(layers: list[nn.Module], dense: list[torch.Tensor], sparsity: float) -> None:
    """Magnitude pruning in place, per layer: each Conv2d/Linear keeps the round((1 - sparsity) n)
    weights of largest |w| of its dense weights ``dense``, the rest become exact zeros."""
    with torch.no_grad():
        for layer, w in zip(weighted(layers), dense):
            keep = round((1.0 - sparsity) * w.numel())
            flat = torch.zeros(w.numel(), device=w.device)
            if keep > 0:
                idx = torch.topk(w.abs().reshape(-1), keep).indices
                flat[idx] = w.reshape(-1)[idx]
            layer.weight.copy_(flat.reshape(w.shape))


def dense_backward_ops(layers: list[nn.Module], input_shape: tuple) -> tuple[int, int]:
    """Per sample, what dense autograd does for the input's gradient (no weight gradients):
    (multiply-adds of Conv2d backward-data and Linear x W, element ops of ReLU and MaxPool2d).
    Convs counted as a dense kernel runs them: c_in c_out kh kw h_out w_out, padding included."""
    macs = elementwise = 0
    shape = tuple(input_shape)
    for layer in layers:
        if isinstance(layer, nn.Conv2d):
            c, h, w = shape
            kh, kw = layer.kernel_size
            ho = (h + 2 * layer.padding[0] - kh) // layer.stride[0] + 1
            wo = (w + 2 * layer.padding[1] - kw) // layer.stride[1] + 1
            macs += c * layer.out_channels // layer.groups * kh * kw * ho * wo
            shape = (layer.out_channels, ho, wo)
        elif isinstance(layer, nn.MaxPool2d):
            c, h, w = shape
            shape = (c, h // 2, w // 2)
            elementwise += c * (h // 2) * (w // 2)  # one scatter-add per output
        elif isinstance(layer, nn.Linear):
            macs += layer.in_features * layer.out_features
            shape = (layer.out_features,)
        elif isinstance(layer, nn.Flatten):
            shape = (math.prod(shape),)
        else:
            elementwise += math.prod(shape)
    return macs, elementwise


def leaf_label(leaf) -> str:
    layer = leaf.layer
    name = type(layer).__name__
    if isinstance(layer, nn.Conv2d):
        name = f"Conv2d {layer.in_channels}->{layer.out_channels}"
    elif isinstance(layer, nn.Linear):
        name = f"Linear {layer.in_features}->{layer.out_features}"
    return f"{name} @ {'x'.join(map(str, leaf.in_shape))}"


def nonzero_values(plan, x: torch.Tensor) -> int:
    """Entries of the stored patterns whose value is non-zero at sample x[0] (pruned weights,
    ReLU's inactive units and the pools' unpicked window positions are zeros)."""
    with torch.no_grad():
        inputs, _ = plan.forward_inputs(x[:1])
    # A Conv2d/Linear leaf's values are its layer's weight as the plan reads it: the chain's layers
    # are plain modules (no parametrization), so .weight is that read; the other leaves take none.
    return sum(int(torch.count_nonzero(leaf.entry_values(inp, getattr(leaf.layer, "weight", None))))
               for leaf, inp in zip(plan.leaves, inputs))


@dataclass
class VggResult:
    """The VGG part: per-layer patterns, then per sparsity the plans' counts, times and errors."""

    setting: dict
    layers: list[dict] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)
    stats: dict[float, dict[str, harness.Stats]] = field(default_factory=dict)


def run_vgg(args, device: torch.device) -> VggResult:
    """Builds VGG-11's chain, ChainPlans once per --vgg-levels, then per sparsity: prune in
    place (the plans see the new weights, as in retraining), plan with pruned=True,
    check the input gradient against autograd and time both, alternated, on `device`
    (the plans are built on the host either way; on CUDA the program runs there)."""
    bppsa = reprop_bppsa()
    res_px = args.vgg_res
    layers = vgg11_chain(args.vgg_width_div, res_px, not args.vgg_features_only)
    model = nn.Sequential(*layers).to(device).eval()  # moves the layers in place
    in_shape = (3, res_px, res_px)
    g = torch.Generator().manual_seed(DATA_SEED)
    x = torch.randn(args.vgg_batch, *in_shape, generator=g)
    with torch.no_grad():
        out_shape = model(x[:1].to(device)).shape[1:]
    grad_out = torch.randn(args.vgg_batch, *out_shape, generator=g).to(device)
    x = x.to(device)
    dense = [m.weight.detach().clone() for m in weighted(layers)]
    macs, elementwise = dense_backward_ops(layers, in_shape)
    result = VggResult({"width_div": args.vgg_width_div, "resolution": res_px, "batch": args.vgg_batch,
                        "device": str(device), "classifier": not args.vgg_features_only,
                        "max_pairs": args.vgg_max_pairs,
                        "weights": sum(w.numel() for w in dense), "dense_macs": macs,
                        "dense_elementwise": elementwise, "reps": args.reps, "warmup": args.warmup})
    print(f"... vgg: VGG-11/{args.vgg_width_div} at {res_px}x{res_px}, planning", file=sys.stderr, flush=True)
    plans = {}
    for levels in args.vgg_levels:
        t0 = time.perf_counter()
        plans[levels] = bppsa.ChainPlan(layers, in_shape, levels=levels, max_pairs=args.vgg_max_pairs)
        result.setting[f"plan_s_L{levels}"] = time.perf_counter() - t0
    first = plans[args.vgg_levels[0]]
    for leaf in first.leaves:
        nnz = int(leaf.indices.shape[0])
        result.layers.append({"layer": leaf_label(leaf), "rows": leaf.rows, "cols": leaf.cols, "nnz": nnz,
                              "density": nnz / (leaf.rows * leaf.cols), "masked_nnz": {}})
    xr = x.clone().requires_grad_()

    def autograd_grad() -> torch.Tensor:
        (gx,) = torch.autograd.grad(model(xr), xr, grad_out)
        return gx

    def forward() -> None:
        with torch.no_grad():
            model(x)

    for sparsity in args.vgg_sparsities:
        print(f"... vgg sparsity {sparsity:g}", file=sys.stderr, flush=True)
        prune_(layers, dense, sparsity)
        masked = {}
        for levels in args.vgg_levels:
            t0 = time.perf_counter()
            masked[levels] = bppsa.ChainPlan(layers, in_shape, levels=levels,
                                             max_pairs=args.vgg_max_pairs, pruned=True)
            if sum(l.indices.shape[0] for l in masked[levels].leaves) == \
                    sum(l.indices.shape[0] for l in plans[levels].leaves):
                masked[levels] = plans[levels]  # no zero weights: the same patterns, timed once
            result.setting[f"masked_plan_s_L{levels}_s{sparsity:g}"] = time.perf_counter() - t0
        for row, leaf in zip(result.layers, masked[args.vgg_levels[0]].leaves):
            row["masked_nnz"][sparsity] = int(leaf.indices.shape[0])
        peers, result.setting["cusparse_na"] = cusparse_plans(bppsa, layers, in_shape, args, device)
        candidates = {V_FWD: forward, V_AUTOGRAD: autograd_grad}
        errors = {}
        with harness.reproducible():  # cuDNN's convolutions without TF32: an fp32 reference (GRAD_TOLERANCE)
            ref = autograd_grad()
            for levels in args.vgg_levels:
                for kind, p in (("chain", plans[levels]), ("masked", masked[levels])):
                    name = vgg_chain_name(kind, levels)
                    if kind == "masked" and p is plans[levels]:
                        errors[name] = errors[vgg_chain_name("chain", levels)]
                        continue
                    errors[name] = harness.relative_error(bppsa.chain_backward(layers, x, grad_out, plan=p)[0], ref)
                    candidates[name] = functools.partial(bppsa.chain_backward, layers, x, grad_out, plan=p)
                if levels in peers:  # its first call plans cuSPARSE's products, before the timing
                    name = vgg_chain_name("cusparse", levels)
                    got = bppsa.chain_backward(layers, x, grad_out, plan=peers[levels])[0]
                    errors[name] = harness.relative_error(got, ref)
                    candidates[name] = functools.partial(bppsa.chain_backward, layers, x, grad_out,
                                                         plan=peers[levels])
        inner = harness.choose_inner(list(candidates.values()), device, args.min_sample_ms)
        result.setting[f"calls_per_sample_s{sparsity:g}"] = inner
        stats = harness.measure_alternated(candidates, device, args.warmup, args.reps, inner)
        result.stats[sparsity] = stats
        kept = sum(int(torch.count_nonzero(m.weight)) for m in weighted(layers))
        nonzero = nonzero_values(plans[args.vgg_levels[0]], x)
        t_fwd, t_auto = stats[V_FWD].median, stats[V_AUTOGRAD].median
        for levels in args.vgg_levels:
            lib, msk = plans[levels], masked[levels]
            t_lib = stats[vgg_chain_name("chain", levels)].median
            t_msk = stats.get(vgg_chain_name("masked", levels), stats[vgg_chain_name("chain", levels)]).median
            peer = stats.get(vgg_chain_name("cusparse", levels))
            t_peer = peer.median if peer else None
            result.rows.append({
                "sparsity": sparsity, "weights_kept": kept, "levels": levels,
                "levels_run": lib.info["levels"], "masked_levels_run": msk.info["levels"],
                "nnz": sum(l.indices.shape[0] for l in lib.leaves), "nonzero_values": nonzero,
                "masked_nnz": sum(l.indices.shape[0] for l in msk.leaves),
                "size": sum(l.rows * l.cols for l in lib.leaves),
                "scan_macs": lib.info["madds"], "masked_scan_macs": msk.info["madds"],
                "linear_macs": lib.info["linear_madds"], "masked_linear_macs": msk.info["linear_madds"],
                "pairs": lib.info["pairs"], "masked_pairs": msk.info["pairs"],
                "dense_ops": macs + elementwise,
                "fwd_ms": t_fwd, "autograd_ms": t_auto, "chain_ms": t_lib, "masked_ms": t_msk,
                "chain_speedup": harness.speedup(t_auto, t_lib),
                "chain_bwd_speedup": backward_speedup(t_auto, t_lib, t_fwd),
                "masked_speedup": harness.speedup(t_auto, t_msk),
                "masked_bwd_speedup": backward_speedup(t_auto, t_msk, t_fwd),
                "chain_err": errors[vgg_chain_name("chain", levels)],
                "masked_err": errors[vgg_chain_name("masked", levels)],
                "cusparse_ms": t_peer, "cusparse_err": errors.get(vgg_chain_name("cusparse", levels)),
                "masked_vs_cusparse": harness.speedup(t_peer, t_msk) if t_peer else None,
            })
        del masked, peers
        harness.release(device)
    return result


VGG_ERRORS = {"chain_err": "chain", "masked_err": "masked", "cusparse_err": "cusparse"}  # row key: kind


def vgg_problems(vgg: VggResult) -> list[str]:
    """The vgg rows' input gradients beyond GRAD_TOLERANCE from autograd's, one line each."""
    return [f"vgg sparsity {r['sparsity']:g} {vgg_chain_name(kind, r['levels'])}: input gradient error "
            f"{r[key]:.2g} vs autograd, beyond {GRAD_TOLERANCE:g} (wrong gradients?)"
            for r in vgg.rows for key, kind in VGG_ERRORS.items() if not harness.within(r[key], GRAD_TOLERANCE)]


def count_cell(n: int) -> str:
    """Large counts in M (10^6) with 3 significant digits."""
    return f"{n / 1e6:.3g}M" if n >= 1e5 else str(n)


def format_vgg(vgg: VggResult) -> str:
    s, f = vgg.setting, harness.fmt
    sparsities = sorted({r["sparsity"] for r in vgg.rows})
    lines = [f"VGG-11 chain (Section 4.3) on {s['device']}: channels / {s['width_div']}, "
             f"{s['resolution']}x{s['resolution']} "
             f"inputs, batch {s['batch']}, {'features + classifier' if s['classifier'] else 'features only'}, "
             f"{count_cell(s['weights'])} weights; dense autograd input-gradient per sample "
             f"{count_cell(s['dense_macs'])} MACs + {count_cell(s['dense_elementwise'])} element ops; "
             f"ChainPlan max_pairs {s['max_pairs']}; plan built in "
             + ", ".join(f"{s[k]:.2g} s ({k[7:]})" for k in s if k.startswith("plan_s_"))]
    headers = ["J^T (input)", "rows x cols", "nnz", "density"] + [f"masked @{p:g}" for p in sparsities]
    rows = [[r["layer"], f"{r['rows']}x{r['cols']}", count_cell(r["nnz"]), f"{r['density']:.2e}"]
            + [count_cell(r["masked_nnz"][p]) for p in sparsities] for r in vgg.layers]
    lines += ["\nper-layer transposed Jacobians (ChainPlan's patterns; masked = without the pruned "
              "weights' explicit zeros)", harness.format_table(headers, rows)]
    headers = ["sparsity", "levels", "J nnz", "nonzero", "masked nnz", "scan MACs", "masked MACs",
               "dense ops", "fwd ms", "autograd", "chain ms", "masked ms", "chain x", "bwd x",
               "masked x", "err", "masked err", "cusparse ms", "vs cusparse", "cusparse err"]
    rows = []
    for r in vgg.rows:
        rows.append([f"{r['sparsity']:g}", f"{r['levels_run']}/{r['masked_levels_run']} ({r['levels']})",
                     count_cell(r["nnz"]), count_cell(r["nonzero_values"]), count_cell(r["masked_nnz"]),
                     count_cell(r["scan_macs"]), count_cell(r["masked_scan_macs"]), count_cell(r["dense_ops"]),
                     f(r["fwd_ms"], ".3g"), f(r["autograd_ms"], ".3g"), f(r["chain_ms"], ".3g"),
                     f(r["masked_ms"], ".3g"), f(r["chain_speedup"], ".2f"), f(r["chain_bwd_speedup"], ".2f"),
                     f(r["masked_speedup"], ".2f"), f(r["chain_err"], ".1e"), f(r["masked_err"], ".1e"),
                     f(r["cusparse_ms"], ".3g"), f(r["masked_vs_cusparse"], ".2f"), f(r["cusparse_err"], ".1e")])
    inner = sorted({v for k, v in vgg.setting.items() if k.startswith("calls_per_sample")})
    lines += [f"\n{vgg.setting['reps']} rounds ({vgg.setting['warmup']} warm-ups, {'/'.join(map(str, inner))} "
              "calls per sample), medians in ms per batch of one "
              "forward + input gradient: autograd = torch.autograd.grad(model(x), x, g); chain / masked = "
              "chain_backward with ChainPlan's patterns / without the pruned weights' zeros (plans built "
              "once, values gathered every call); fwd = a no-grad forward; chain x = autograd / chain, "
              "bwd x = (autograd - fwd) / (chain - fwd), masked x = autograd / masked; err = "
              "max|dx - dx_autograd| / max|dx_autograd|; MACs = multiply-adds per sample "
              "(ChainPlan.info madds; dense ops = autograd's MACs + element ops); cusparse = the masked "
              "plan with product='cusparse' (the same schedule, products by cusparseSpGEMMreuse_compute, "
              "mat-vecs by cusparseSpMM; cuSPARSE's planning in its first call, untimed), vs cusparse = "
              "cusparse / masked (> 1: ours faster)"]
    if s.get("cusparse_na"):
        lines.append(f"cuSPARSE peer not run: {s['cusparse_na']}")
    lines += ["\nper sparsity and schedule (levels run: chain/masked (requested)); counts per sample, "
              "times per batch", harness.format_table(headers, rows)]
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------


def int_list(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip())


def float_list(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.split(",") if v.strip())


def str_list(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def scan_arg(text: str) -> str | int:
    """--scan: auto, blelloch, linear, or a non-negative number of up-sweep levels."""
    if text in SCANS:
        return text
    if text.isdigit():
        return int(text)
    raise ValueError(text)


def parse_args(argv: list[str] | None = None):
    """Shared harness options plus the sweeps, their fixed axes, the scan and the memory cap."""
    p = harness.make_parser(__doc__.splitlines()[0])
    p.add_argument("--part", action="append", choices=PARTS, default=None,
                   help="sweep to run (repeatable; default all)")
    p.add_argument("--scan", type=scan_arg, default="auto",
                   help="reprop.bppsa scan: auto (cost model, default), blelloch, linear, or a number of levels")
    p.add_argument("--seq-lens", type=int_list, default=None, help="rnn-t sweep's T values (comma-separated)")
    p.add_argument("--batches", type=int_list, default=None, help="rnn-batch sweep's B values")
    p.add_argument("--hiddens", type=int_list, default=None, help="rnn-hidden sweep's d values")
    p.add_argument("--gru-sets", type=str_list, default=None, help="gru sweep's MFCC sets (S, M, L)")
    p.add_argument("--gru-batches", type=int_list, default=None, help="gru sweep's B values")
    p.add_argument("--seq-len", type=int, default=None, help="T of the batch and hidden sweeps (default 1000; quick 100)")
    p.add_argument("--batch", type=int, default=16, help="B of the T and hidden sweeps (default 16)")
    p.add_argument("--hidden", type=int, default=20, help="d of the T and batch sweeps (default 20)")
    p.add_argument("--mem-cap-gib", type=float, default=40.0,
                   help="CUDA: skip configurations estimated above this many GiB (default 40; 0: no cap)")
    p.add_argument("--min-sample-ms", type=float, default=None,
                   help="repeat calls within a sample until it lasts this long (default 1 on cuda, 0 on cpu)")
    p.add_argument("--vgg-width-div", type=int, default=None,
                   help="vgg: VGG-11's channels divided by this (default 8; quick 16; 1: the real widths)")
    p.add_argument("--vgg-res", type=int, default=32, help="vgg: input resolution (default 32, CIFAR-10's)")
    p.add_argument("--vgg-batch", type=int, default=None, help="vgg: batch size (default 4)")
    p.add_argument("--vgg-sparsities", type=float_list, default=None,
                   help="vgg: fractions of weights pruned (default 0,0.5,0.9,0.97; the paper's 0.97)")
    p.add_argument("--vgg-levels", type=int_list, default=None,
                   help="vgg: up-sweep levels of the ChainPlans (default 0,3: linear and the paper's L0-L2)")
    p.add_argument("--vgg-max-pairs", type=int, default=0,
                   help="vgg: ChainPlan max_pairs, the cap on one planned product's pairs (default 0: none; "
                        "a level whose products pass it is dropped whole)")
    p.add_argument("--vgg-features-only", action="store_true",
                   help="vgg: the conv features only (the paper's chain), without the classifier's Linear layers")
    args = p.parse_args(argv)
    defaults = QUICK if args.quick else FULL
    for key in ("seq_lens", "batches", "hiddens", "gru_sets", "gru_batches", "seq_len", "reps", "warmup"):
        if getattr(args, key) is None:
            setattr(args, key, defaults[key])
    for key, value in (VGG_QUICK if args.quick else VGG_FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.vgg_res < 32 or args.vgg_res % 32:
        p.error("--vgg-res: a multiple of 32 (five 2x2 pools)")
    if any(not 0 <= v < 1 for v in args.vgg_sparsities):
        p.error("--vgg-sparsities: fractions in [0, 1)")
    if not args.vgg_levels or any(v < 0 for v in args.vgg_levels):
        p.error("--vgg-levels: non-negative integers")
    args.part = tuple(args.part or PARTS)
    if args.min_sample_ms is None:
        args.min_sample_ms = 1.0 if args.device == "cuda" else 0.0
    unknown = [s for s in args.gru_sets if s not in models.MFCC_SHAPES]
    if unknown:
        p.error(f"--gru-sets: unknown {', '.join(unknown)}; known: {', '.join(models.MFCC_SHAPES)}")
    return args


# ---------------------------------------------------------------------------
# The graph part: both sides' calls replayed from CUDA graphs
# ---------------------------------------------------------------------------


def captured_calls(trainer: Trainer, x: torch.Tensor, y: torch.Tensor, args) -> dict[str, Callable]:
    """The trainer's forward-only call and training step (Trainer.forward,
    Trainer.step), each captured once (reprop.ooo.capture: warm-up on a side
    stream, static copies of x and y) and then a replay. The step ends with
    the gradients set to None, so the captured backward allocates them from
    the graph's pool, as each eager step's backward allocates its own."""
    from reprop import ooo

    forward = ooo.capture(trainer.forward, x, y, warmup=args.warmup + 1)
    train = ooo.capture(trainer.step, x, y, warmup=args.warmup + 1)
    return {"forward": lambda: forward(x, y), "step": lambda: train(x, y)}


def run_graph(args, device: torch.device) -> dict | None:
    """The graph part's times (ms medians) and speedups, or None off CUDA."""
    cfg = rnn_config(args.seq_len, args.batch, args.hidden)
    if device.type != "cuda":
        print(f"\ngraph\nn/a: CUDA graphs need --device cuda ({cfg.label})", flush=True)
        return None
    x, y = make_data(cfg, device)
    base = captured_calls(make_trainer(cfg, device, capturable=True), x, y, args)
    ours = captured_calls(make_trainer(cfg, device, args.scan, capturable=True), x, y, args)
    candidates = {FWD: base["forward"], BASE: base["step"], FWD_OURS: ours["forward"], OURS: ours["step"]}
    inner = harness.choose_inner(list(candidates.values()), device, args.min_sample_ms)
    stats = harness.measure_alternated(candidates, device, args.warmup, args.reps, inner)
    ms = {name: st.median for name, st in stats.items()}
    result = {"config": cfg.label, "ms": ms, "inner": inner,
              "bwd_x": backward_speedup(ms[BASE], ms[OURS], ms[FWD], ms[FWD_OURS]),
              "e2e_x": harness.speedup(ms[BASE], ms[OURS])}
    rows = [[cfg.label, *(harness.fmt(ms[n], ".3f") for n in (FWD, BASE, FWD_OURS, OURS)),
             harness.fmt(result["bwd_x"], ".2f"), harness.fmt(result["e2e_x"], ".2f")]]
    print("\ngraph (every call a CUDA graph replay; ms)\n"
          + harness.format_table(["config", "fwd", "cuDNN step", "fwd ours", "BPPSA step", "bwd x", "e2e x"],
                                 rows), flush=True)
    return result


# ---------------------------------------------------------------------------
# The scan part: the scan alone at every levels, and its kernels
# ---------------------------------------------------------------------------


def scan_operands(args, device: torch.device) -> dict:
    """The RNN backward's scan operands at T = --seq-len, B = --batch, d = --hidden:
    c, W_hh (spectral radius about 1) and the tanh outputs y."""
    T, B, H = args.seq_len, args.batch, args.hidden
    g = torch.Generator().manual_seed(DATA_SEED)
    return {"c": torch.randn(T, B, H, generator=g).to(device),
            "w": (torch.randn(H, H, generator=g) / H ** 0.5).to(device),
            "y": torch.tanh(torch.randn(T, B, H, generator=g)).to(device)}


def scan_kernel_times(call: Callable[[], object], reps: int) -> list[dict]:
    """Each CUDA kernel's mean GPU time over `reps` calls (torch.profiler), by total time."""
    from torch.profiler import ProfilerActivity, profile
    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            call()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: -e.device_time_total)
    return [{"kernel": e.key[:90], "launches_per_call": e.count / reps,
             "us_per_launch": e.device_time_total / max(1, e.count)} for e in kernels]


def run_scan(args, device: torch.device) -> dict:
    """The scan part's rows (ms per call, x the linear scan) and, on CUDA, its kernels."""
    bp = reprop_bppsa()
    T, B, H = args.seq_len, args.batch, args.hidden
    ops = scan_operands(args, device)
    pick = bp.scan_levels(T, B, H, 1, device)

    def scan_at(levels: int) -> Callable[[], object]:
        return functools.partial(bp.scan, ops["c"], w=ops["w"], activation="tanh", y=ops["y"],
                                 pre_activation=True, levels=levels)

    candidates = {levels: scan_at(levels) for levels in range(bp.max_levels(T) + 1)}
    inner = harness.choose_inner(list(candidates.values()), device, args.min_sample_ms)
    stats = harness.measure_alternated(candidates, device, args.warmup, args.reps, inner)
    linear = stats[0].median
    rows = [{"levels": levels, "picked": levels == pick, "ms": st.median,
             "x_linear": harness.speedup(linear, st.median)} for levels, st in stats.items()]
    label = f"T={T} B={B} d={H}"
    print(f"\nscan alone ({label}; ms per call, medians; * the cost model's pick)\n" + harness.format_table(
        ["levels", "ms", "x linear"],
        [[f"{r['levels']}{' *' if r['picked'] else ''}", harness.fmt(r["ms"], ".4f"),
          harness.fmt(r["x_linear"], ".2f")] for r in rows]), flush=True)
    kernels = scan_kernel_times(scan_at(pick), args.reps) if device.type == "cuda" else []
    if kernels:
        print(f"\nscan kernels at levels {pick} (GPU us per launch)\n" + harness.format_table(
            ["kernel", "launches a call", "us a launch"],
            [[k["kernel"], harness.fmt(k["launches_per_call"], ".3g"), harness.fmt(k["us_per_launch"], ".1f")]
             for k in kernels]), flush=True)
    return {"config": label, "rows": rows, "kernels": kernels, "inner": inner}


def check_reprop() -> None:
    """Exit with a clear message when reprop.bppsa is missing."""
    try:
        reprop_bppsa()
    except Exception as e:  # noqa: BLE001
        raise SystemExit(f"cannot import reprop.bppsa ({describe_error(e)}); install reprop (pip install -e .)")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = harness.setup_device(args)
    check_reprop()
    info = harness.machine_info(device)
    print(harness.describe_machine(info), flush=True)
    sweeps = plan(args)
    payload, failed = (run_sweeps(sweeps, info, device, args) if sweeps
                       else (json_payload([], {}, [], info, args), False))
    if "vgg" in args.part:
        vgg = run_vgg(args, device)
        print("\n" + format_vgg(vgg), flush=True)
        problems = vgg_problems(vgg)
        harness.print_check(f"input gradients within {GRAD_TOLERANCE:g} of autograd's (err, masked err, "
                            "cusparse err)", problems)
        failed = failed or bool(problems)
        payload["vgg"] = {"setting": vgg.setting, "layers": vgg.layers, "rows": vgg.rows,
                          "stats_ms": {str(p): {n: st.to_dict() for n, st in st_.items()}
                                       for p, st_ in vgg.stats.items()}}
        harness.write_json(args.json, payload)
    if "graph" in args.part:
        graph = run_graph(args, device)
        payload["graph"] = {"rows": [graph]} if graph is not None else None
        harness.write_json(args.json, payload)
    if "scan" in args.part:
        payload["scan"] = run_scan(args, device)
        harness.write_json(args.json, payload)
    harness.exit_if_failed(failed)


if __name__ == "__main__":
    main()
