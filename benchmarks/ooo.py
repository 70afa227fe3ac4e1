"""Benchmark reprop.ooo (out-of-order backprop) against eager PyTorch, DDP and GPipe.

Parts (--parts, default all that run on the device):

  single    one device, the user's unchanged loop (SGD with momentum, as the
            paper reports), synthetic data; candidates alternated in one run:
              eager         plain PyTorch
              graph         the whole step captured in one CUDA graph (CUDA only)
              ooo           reprop.ooo.enable(model): dW deferred, on CUDA on a
                            sub-stream (the lowest priority), placed by Algorithm 1
              ooo+graph     the same, captured in one CUDA graph (CUDA only)
            throughput (images/s) and peak memory of a step (eager and ooo:
            a CUDA graph's replay allocates nothing, its memory is taken at
            capture; "extra peak" = ooo's over eager's), and the gain
            of each part as the paper's Figure 7 (graph over eager, ooo+graph
            over graph). Every candidate takes the same steps from identical
            copies, the RNG seeded alike; then each one's parameters and
            gradients must equal eager's (bitwise on the CPU). Models after
            the paper: DenseNet-121 (growth 12, 24, 32), MobileNetV3-Large
            (width 0.25 to 1.0), ResNet-50; batch 32, 64.
  split     the Python cost of the split itself: a training step (forward and
            backward, no optimizer) of chains of 200 small layers, Linear(16, 16)
            and Conv2d(4, 4, 3) + BatchNorm2d(4), plain autograd against every
            layer split (order="conventional": dW right after dO), alternated;
            microseconds per layer and the difference, which is what an eager
            run pays per split layer on top of its kernels (a captured CUDA
            graph pays none of it).
  simulate  the scheduler core's simulator with the paper's settings:
            data parallel ResNet-50 (380 ms of computation per iteration) on
            16, 32, 48 GPUs as the paper's Pub-A cluster, nodes of 4 V100 on
            NVLink and a ring over the nodes between them, at 10, 5, 2.5 Gb/s
            and at the bandwidth calibrated to the 350 ms all-reduce the paper
            reports at 16 GPUs (conventional with FIFO all-reduce, prioritised
            all-reduce as BytePS, reverse first-k with k searched as in
            Section 5.1), next to the paper's 1.10-1.27x; pipeline
            BERT-48-like stacks (GPipe, fast-forwarding, + modulo allocation)
            next to 1.41-1.99x.
  dist      measured on CPU processes with gloo (default on CPU): ranks
            spawned on this machine, file:// rendezvous, one torch thread each,
            so the ranks share its cores and this measures overhead and
            correctness, not the GPU speedup.
              data parallel, 2 ranks, ResNet-18 at 32x32, SGD with momentum:
              torch's DistributedDataParallel against reprop.ooo.data_parallel
              with k=0 (its bucketing, no reordering), k="auto" (after its
              search settled) and a fixed k, alternated iteration by
              iteration; then the parameters must equal DDP's.
              pipeline, 2 and 4 ranks (--quick: 2), 16 Linear+GELU blocks:
              reprop.ooo.Pipeline GPipe contiguous against fast-forwarding
              contiguous and fast-forwarding modulo, and torch's own
              torch.distributed.pipelining ScheduleGPipe on the same stages;
              the gradients after one step must equal single-process
              training's and GPipe's.
            iteration / step time, ratio to DDP / GPipe (and torch's GPipe).
  A correctness failure (single or dist) makes the script exit with status 1.

    python benchmarks/ooo.py --quick                   # CPU: small single part, simulate, dist
    python benchmarks/ooo.py --parts dist --json out.json   # the measured distributed part alone
    python benchmarks/ooo.py --device cuda --json out.json
"""

from __future__ import annotations

import copy
import datetime
import gc
import json
import os
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
import models  # noqa: E402
from reprop import ooo  # noqa: E402

FULL_MODELS = ["densenet121_k12", "densenet121_k24", "densenet121", "mobilenet_v3_large_0.25",
               "mobilenet_v3_large_0.5", "mobilenet_v3_large_0.75", "mobilenet_v3_large",
               "resnet50"]
QUICK_MODELS = ["densenet121_k12"]


# ---------------------------------------------------------------------------
# Single device
# ---------------------------------------------------------------------------


class Trainer:
    """One candidate: a model copy, its optimizer, and a step() on fixed data."""

    def __init__(self, base: nn.Module, x: torch.Tensor, y: torch.Tensor, use_ooo: bool,
                 graph: bool):
        self.model = copy.deepcopy(base).to(x.device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-6, momentum=0.9)
        self.handle = ooo.enable(self.model) if use_ooo else None
        self.x, self.y = x.clone(), y.clone()  # static inputs: a CUDA graph reads these
        self.graph = None
        self.steps = 0  # training steps run, so that every candidate can be brought to the same count
        if graph:
            self._capture()

    def _eager_step(self) -> None:
        self.opt.zero_grad(set_to_none=False)
        models.cross_entropy(self.model(self.x), self.y).backward()
        self.opt.step()

    def _capture(self) -> None:
        # torch's recipe: warm up on a side stream (the ooo profile runs here
        # too, so the captured step is the fixed schedule), then capture.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        warmup = max(3, self.handle._profile_passes() + 1 if self.handle else 3)
        with torch.cuda.stream(side):
            for i in range(warmup):
                torch.manual_seed(i)  # as seeded_step: the same dropout masks as the other candidates
                self._eager_step()
        self.steps = warmup  # the capture below records a step without running it
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._eager_step()

    def step(self) -> None:
        self.steps += 1
        if self.graph is not None:
            self.graph.replay()
        else:
            self._eager_step()

    def seeded_step(self) -> None:
        """step() with the RNG seeded by the step's number: every candidate's n-th step draws the same
        dropout masks (MobileNetV3's classifier), so that their results can be compared."""
        torch.manual_seed(self.steps)
        self.step()

    def state(self) -> dict[str, torch.Tensor]:
        """Parameters and their gradients (as "<name>.grad"), by name."""
        named = dict(self.model.named_parameters())
        return {**{n: p.detach() for n, p in named.items()},
                **{f"{n}.grad": p.grad for n, p in named.items() if p.grad is not None}}


def settle(trainers: dict[str, Trainer]) -> None:
    """Steps every trainer past the ooo profile (the fixed schedule is what is timed), then the
    others up to the same count: then all have taken the same seeded steps from identical copies."""
    for t in trainers.values():
        for _ in range(4):
            t.seeded_step()
        while t.handle is not None and t.handle.schedule is None:
            t.seeded_step()
    steps = max(t.steps for t in trainers.values())
    for t in trainers.values():
        while t.steps < steps:
            t.seeded_step()


def single_mismatch(trainers: dict[str, Trainer], device: torch.device) -> dict[str, str | None]:
    """Each candidate's check_close of its parameters and gradients against eager's, after the same steps.

    Bitwise on the CPU (README: the split calls autograd's own kernels, bitwise
    where a weight is used once per backward, as in these models); on CUDA
    within GRAD_RTOL, GRAD_ATOL, run under harness.reproducible() (cuDNN's
    deterministic algorithms, no TF32): the split may still pick other
    algorithms for dX and dW alone than the fused backward does.
    """
    rtol, atol = (0.0, 0.0) if device.type == "cpu" else (GRAD_RTOL, GRAD_ATOL)
    want = trainers["eager"].state()
    return {label: harness.check_close(t.state(), want, rtol, atol)
            for label, t in trainers.items() if label != "eager"}


def step_peaks(trainers: dict[str, Trainer], device: torch.device) -> dict[str, int | None]:
    """harness.peak_memory of one step of each eager candidate; None for the captured ones.

    A CUDA graph's replay calls no allocator: its step's memory is the graph's
    pool, taken at capture, so peak_memory read 0 bytes for graph and ooo+graph
    (and the table's extra peak fell back to ooo over eager unannounced). The
    eager step of the same model is what the capture allocated.
    """
    return {label: None if t.graph is not None else harness.peak_memory(t.step, device)
            for label, t in trainers.items()}


def make_trainers(base: nn.Module, x: torch.Tensor, y: torch.Tensor,
                  kinds: dict[str, tuple[bool, bool]]) -> tuple[dict[str, Trainer], dict[str, str]]:
    """A Trainer per label of `kinds` (label: (use_ooo, graph)), and the error of each that could not be made."""
    trainers, errors = {}, {}
    for label, (use_ooo, graph) in kinds.items():
        try:
            trainers[label] = Trainer(base, x, y, use_ooo, graph)
        except Exception as exc:  # report, do not hide: e.g. what capture refused
            errors[label] = f"{type(exc).__name__}: {exc}"[:120]
    return trainers, errors


def run_single(args, device: torch.device) -> list[dict]:
    names = QUICK_MODELS if args.quick else args.models
    batches = [8] if args.quick and device.type == "cpu" else args.batches
    image = 64 if device.type == "cpu" else 224
    cuda = device.type == "cuda"
    rows = []
    for name in names:
        for batch in batches:
            base = models.build(name)
            x, y = models.make_batch(name, batch, device, image_size=image)
            kinds = {"eager": (False, False), "ooo": (True, False)}
            if cuda:
                kinds.update({"graph": (False, True), "ooo+graph": (True, True)})
            with harness.reproducible():  # the check's copies: cuDNN's atomics would blur it
                trainers, errors = make_trainers(base, x, y, kinds)
                settle(trainers)
                steps, mismatch = trainers["eager"].steps, single_mismatch(trainers, device)
            if cuda:  # timed with cuDNN's default algorithms, as users train: captured anew
                del trainers
                harness.release(device)  # (an ooo model, its hooks and its handle are a cycle)
                checked = errors
                trainers, errors = make_trainers(base, x, y, kinds)
                errors.update({f"{label} (check)": err for label, err in checked.items() if label not in errors})
                settle(trainers)
            stats = harness.measure_alternated({k: t.step for k, t in trainers.items()}, device,
                                               warmup=args.warmup, reps=args.reps)
            peaks = step_peaks(trainers, device)
            row = {"model": name, "batch": batch, "errors": errors,
                   "ms": {k: s.median for k, s in stats.items()},
                   "images_per_s": {k: batch / (s.median / 1e3) for k, s in stats.items()},
                   "peak_bytes": peaks,
                   "schedule": trainers["ooo"].handle.schedule if "ooo" in trainers else None,
                   "steps": steps, "cpu": not cuda, "mismatch": mismatch}
            rows.append(row)
            del trainers
            if cuda:
                harness.release(device)
    return rows


SPLIT_CHAINS = {
    "Linear(16, 16)": (lambda: [nn.Linear(16, 16) for _ in range(200)], (4, 16)),
    "Conv2d(4, 4, 3) + BatchNorm2d(4)": (
        lambda: [m for _ in range(100) for m in (nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4))],
        (2, 4, 8, 8)),
}


def run_split(args, device: torch.device) -> list[dict]:
    rows = []
    for name, (layers, shape) in SPLIT_CHAINS.items():
        torch.manual_seed(0)
        plain = nn.Sequential(*layers()).to(device)
        split = copy.deepcopy(plain)
        ooo.enable(split, order="conventional")
        x = torch.randn(*shape, device=device)

        def step(model):
            for p in model.parameters():
                p.grad = None
            model(x).sum().backward()

        stats = harness.measure_alternated({"eager": lambda: step(plain), "split": lambda: step(split)},
                                           device, warmup=max(args.warmup, 3), reps=max(args.reps, 20))
        per_layer = {k: s.median * 1e3 / len(plain) for k, s in stats.items()}
        rows.append({"chain": name, "layers": len(plain), "us_per_layer": per_layer,
                     "split_cost_us": per_layer["split"] - per_layer["eager"],
                     "ratio": per_layer["eager"] / per_layer["split"]})
    return rows


def print_split(rows: list[dict]) -> None:
    print("\nsplit cost per layer (forward + backward, us; eager / split = ratio)")
    print(f"{'chain':<34} {'layers':>6} {'eager':>8} {'split':>8} {'cost':>8} {'ratio':>6}")
    for r in rows:
        us = r["us_per_layer"]
        print(f"{r['chain']:<34} {r['layers']:>6} {us['eager']:>8.1f} {us['split']:>8.1f} "
              f"{r['split_cost_us']:>8.1f} {r['ratio']:>6.3f}")


def print_single(rows: list[dict]) -> None:
    labels = ["eager", "graph", "ooo", "ooo+graph"]
    headers = ["model", "batch"] + [f"{l} img/s" for l in labels] + \
              ["graph/eager", "ooo/eager", "ooo+graph/graph", "ooo+graph/eager", "extra peak (ooo/eager)"]
    table = []
    for r in rows:
        ips = r["images_per_s"]

        def ratio(a, b):
            return ips[a] / ips[b] if a in ips and b in ips else None

        peak = r["peak_bytes"]  # eager steps only (step_peaks): ooo's extra is ooo+graph's too
        extra = peak["ooo"] / peak["eager"] - 1 if peak.get("ooo") and peak.get("eager") else None
        table.append([r["model"], r["batch"]] + [harness.fmt(ips.get(l), ".1f") for l in labels] +
                     [harness.fmt(ratio("graph", "eager"), ".3f"), harness.fmt(ratio("ooo", "eager"), ".3f"),
                      harness.fmt(ratio("ooo+graph", "graph"), ".3f"),
                      harness.fmt(ratio("ooo+graph", "eager"), ".3f"),
                      "n/a" if extra is None else f"{extra * 100:+.1f}%"])
    print(harness.format_table(headers, table))
    for r in rows:
        for label, err in r["errors"].items():
            print(f"  {r['model']} b{r['batch']} {label}: {err}")
        print(f"{r['model']} b{r['batch']}: parameters and gradients equal to eager's after the same "
              f"{r['steps']} seeded steps ({'bitwise' if r['cpu'] else f'rtol {GRAD_RTOL:g}, atol {GRAD_ATOL:g}'}): "
              f"{yes_or_why(r['mismatch'])}")
        if r["schedule"] is not None:
            print(f"{r['model']} b{r['batch']}: {schedule_summary(r['schedule'])}")


def schedule_summary(s: dict) -> str:
    """The fixed schedule's moves and what its memory cap allowed (ooo.enable's
    max_extra_memory: on CUDA per region end, from the step's peak P)."""
    base = s.get("base_peak_bytes")
    held = max(s.get("held_bytes") or [0])
    return (f"{s['moved']} dW moved over {s['regions']} regions, cap base {s.get('cap_base')}, "
            f"most held at a region end {held / 2**20:.1f} MiB"
            + ("" if not base else f" ({held / base * 100:.1f}% of P = {base / 2**20:.1f} MiB)"))


# ---------------------------------------------------------------------------
# Simulation at scale
# ---------------------------------------------------------------------------


def layer_profile(model: nn.Module, image: int = 224) -> tuple[list[float], list[int]]:
    """Per parameterised layer in forward order: its share of the forward
    multiply-adds (convolutions and linears; norms count as tiny) and its
    parameter bytes (what its all-reduce moves)."""
    macs, sizes = [], []

    def hook(m, inp, out):
        w = m.weight
        if isinstance(m, nn.Conv2d):
            macs.append(out.numel() * w.shape[1] * w.shape[2] * w.shape[3])
        elif isinstance(m, nn.Linear):
            macs.append(out.numel() * w.shape[1])
        else:
            macs.append(out.numel() * 4)  # a norm: a few operations per element
        sizes.append(sum(p.numel() * p.element_size() for p in m.parameters(recurse=False)))

    handles = [m.register_forward_hook(hook) for m in model.modules()
               if any(True for _ in m.parameters(recurse=False))]
    with torch.no_grad():
        model.eval()(torch.zeros(1, 3, image, image))
    for h in handles:
        h.remove()
    total = float(sum(macs))
    return [m / total for m in macs], sizes


# The paper's Pub-A cluster (Table 2, AWS p3.8xlarge) and its Section 8.3 discussion
GPUS_PER_NODE = 4            # V100s per node, on NVLink
NVLINK_BW = 25e9             # bytes/s: one NVLink 2.0 link each way, what a ring inside a node gets
INTER_LATENCY = 25e-6        # s per message between nodes (TCP over Ethernet)
DP_COMPUTE = 0.380           # s of computation per ResNet-50 iteration, 16 x V100
PAPER_SYNC_16 = 0.350        # s BytePS spends on the synchronisation at 16 GPUs
SWEEP_GBPS = [10.0, 5.0, 2.5]  # effective inter-node bandwidths (10: the nominal link)


def hierarchical_sync(sizes: list[int], gpus: int, inter_bw: float) -> list[float]:
    """Each layer's all-reduce time on nodes of GPUS_PER_NODE GPUs: reduce-scatter
    and all-gather inside the node over NVLink (together an all-reduce's volume)
    and a ring over the nodes between them. The node's GPUs share one NIC, so
    the node ring moves the whole tensor at the node's bandwidth: its workers
    are the nodes, not the GPUs. The NVLink part is a few percent of the rest
    at 10 Gb/s, less below it."""
    nodes = max(1, gpus // GPUS_PER_NODE)
    inside = min(gpus, GPUS_PER_NODE)
    return [ooo.allreduce_time(b, nodes, inter_bw, INTER_LATENCY) + ooo.allreduce_time(b, inside, NVLINK_BW)
            for b in sizes]


def calibrated_bandwidth(sizes: list[int], gpus: int, target: float) -> float:
    """The inter-node bandwidth (bytes/s) at which the per-layer all-reduces of
    the whole model add up to `target` seconds. The time is a / bandwidth + c
    (c: latencies and NVLink, which do not depend on it), so solve for it."""
    c = sum(hierarchical_sync(sizes, gpus, float("inf")))
    a = sum(hierarchical_sync(sizes, gpus, 1.0)) - c
    if target <= c:
        raise ValueError(f"target {target * 1e3:.0f} ms is below the latency floor {c * 1e3:.0f} ms")
    return a / (target - c)


def simulate_dp_case(per: list[float], sync: list[float]) -> dict:
    """One cluster setting: iteration period with FIFO all-reduce (autograd's
    order), prioritised all-reduce (lower layers first, as BytePS), and
    reverse first-k with the k the paper's search finds on the simulator."""
    layers = len(per)
    common = dict(fwd=per, out_grad=per, weight_grad=per, sync=sync, iterations=2)

    def ours(k: int) -> float:
        return ooo.simulate(layers, order="reverse_first_k", k=k, **common).period

    fifo = ooo.simulate(layers, sync_by_layer=False, **common).period
    prio = ooo.simulate(layers, **common).period
    k, _ = ooo.search_k(layers, lambda k: 1.0 / ours(k))
    best = ours(k)
    return {"allreduce_ms": sum(sync) * 1e3, "fifo_ms": fifo * 1e3, "priority_ms": prio * 1e3,
            "reverse_first_k_ms": best * 1e3, "k": k, "speedup_over_priority": prio / best,
            "speedup_over_fifo": fifo / best}


def simulate_data_parallel(gpus: list[int]) -> dict:
    """ResNet-50 data parallel, the paper's Section 8.3 discussion: 380 ms of
    computation per iteration (forward, dO, dW in equal parts, split over the
    layers by their multiply-adds), hierarchical all-reduce (hierarchical_sync)
    at each of SWEEP_GBPS between nodes and at the bandwidth where the whole
    model's all-reduce takes the paper's 350 ms at 16 GPUs."""
    share, sizes = layer_profile(models.build("resnet50"))
    per = [DP_COMPUTE / 3 * s for s in share]
    calibrated = calibrated_bandwidth(sizes, 16, PAPER_SYNC_16)
    settings = [(g * 1e9 / 8, False) for g in SWEEP_GBPS] + [(calibrated, True)]
    rows = []
    for n in gpus:
        for bw, is_calibrated in settings:
            rows.append({"gpus": n, "nodes": max(1, n // GPUS_PER_NODE), "layers": len(per),
                         "inter_gbps": bw * 8 / 1e9, "calibrated": is_calibrated,
                         **simulate_dp_case(per, hierarchical_sync(sizes, n, bw))})
    return {"compute_ms": DP_COMPUTE * 1e3, "calibrated_gbps": calibrated * 8 / 1e9,
            "nvlink_gbytes_per_s": NVLINK_BW / 1e9, "rows": rows}


def simulate_pipeline(cases: list[tuple[int, int, int]]) -> list[dict]:
    """Uniform transformer-like layers (forward 1, dO 1, dW 1 units), the
    paper's NVLink communication-to-computation ratio of 0.05 per transfer."""
    rows = []
    for layers, stages, micro in cases:
        common = dict(num_stages=stages, micro_batches=micro, transfer=0.05)
        gpipe = ooo.simulate(layers, **common).makespan
        ff = ooo.simulate(layers, order="fast_forward", **common).makespan
        mod = ooo.simulate(layers, order="fast_forward", allocation="modulo", **common).makespan
        rows.append({"layers": layers, "gpus": stages, "micro_batches": micro, "gpipe": gpipe,
                     "fast_forward": ff, "modulo": mod, "ff_speedup": gpipe / ff,
                     "modulo_speedup": gpipe / mod})
    return rows


def print_simulation(dp: dict, pipe: list[dict]) -> None:
    print(f"\nData parallel, ResNet-50, simulated: {dp['compute_ms']:.0f} ms of computation per "
          f"iteration; nodes of {GPUS_PER_NODE} GPUs on NVLink ({dp['nvlink_gbytes_per_s']:.0f} GB/s, "
          "cheap next to the rest), a ring over the nodes between them (paper: 1.10-1.27x over "
          "BytePS on 16-48 GPUs, 1.27x for ResNet-50 on 16)")
    print(f"calibrated: {dp['calibrated_gbps']:.2f} Gb/s effective between nodes makes the whole "
          f"model's all-reduce take the paper's {PAPER_SYNC_16 * 1e3:.0f} ms at 16 GPUs")
    print(harness.format_table(
        ["GPUs", "nodes", "Gb/s", "all-reduce ms", "FIFO ms", "prioritised ms", "reverse first-k ms",
         "k", "x prioritised", "x FIFO"],
        [[r["gpus"], r["nodes"],
          harness.fmt(r["inter_gbps"], ".2f") + (" (calibrated)" if r["calibrated"] else ""),
          harness.fmt(r["allreduce_ms"], ".1f"), harness.fmt(r["fifo_ms"], ".1f"),
          harness.fmt(r["priority_ms"], ".1f"), harness.fmt(r["reverse_first_k_ms"], ".1f"), r["k"],
          harness.fmt(r["speedup_over_priority"], ".3f"), harness.fmt(r["speedup_over_fifo"], ".3f")]
         for r in dp["rows"]]))
    print("the simulator's prioritised all-reduce is ideal (per-layer priority, no partitioning or "
          "credit effects): \"x prioritised\" is a lower bound on the gain over a real prioritising "
          "system such as BytePS; \"x FIFO\" is the gain over a system that does not prioritise. "
          "Where the all-reduce takes longer than the computation it bounds the period: every k "
          "ties and the k shown is arbitrary")
    print("\nPipeline, uniform layers, simulated (paper: OOO-Pipe2 1.41-1.99x over GPipe)")
    print(harness.format_table(
        ["layers", "GPUs", "micro", "GPipe", "fast-fwd", "+modulo", "ff x", "modulo x"],
        [[r["layers"], r["gpus"], r["micro_batches"], harness.fmt(r["gpipe"], ".1f"),
          harness.fmt(r["fast_forward"], ".1f"), harness.fmt(r["modulo"], ".1f"),
          harness.fmt(r["ff_speedup"], ".3f"), harness.fmt(r["modulo_speedup"], ".3f")]
         for r in pipe]))


# ---------------------------------------------------------------------------
# Distributed, measured: CPU processes with gloo
# ---------------------------------------------------------------------------

# ResNet-18 at CIFAR size: the residual CNN family of the paper's data-parallel
# evaluation, ~0.2 s per iteration on one core, and its 11.7 M parameters
# (47 MB of gradients) against little computation at 32x32 make the
# all-reduce a large share of the iteration, the regime reverse first-k is for.
# (ResNet-50 takes twice as long, too long for the ~50 iterations of the search.)
DP_MODEL, DP_IMAGE, DP_BATCH = "resnet18", 32, 16
BUCKET_MB = 25.0  # DDP's default bucket_cap_mb and data_parallel's: both get the same
SEARCH_LIMIT = 300  # iterations the k="auto" search may take before the run fails
# Uniform layers, so unit task costs (Pipeline's default) are the right plan;
# width 512, batch 64 in 4 micro-batches: a step takes tens of ms on one core.
PIPE_LAYERS, PIPE_WIDTH, PIPE_BATCH, PIPE_MICRO = 16, 512, 64, 4
PIPE_CANDIDATES = [("gpipe", "contiguous"), ("fast_forward", "contiguous"),
                   ("fast_forward", "modulo")]  # the first is the baseline
# torch's own pipeline (torch.distributed.pipelining.ScheduleGPipe over the same contiguous
# stages): the peer in torch. Before, the schedules were compared with reprop's GPipe alone.
TORCH_GPIPE = "torch GPipe"
GRAD_RTOL, GRAD_ATOL = 1e-5, 1e-7  # micro-batches' dW summed in another order
PARAM_RTOL, PARAM_ATOL = 1e-6, 1e-7  # data parallel: lockstep on the same data


def _rank_main(rank: int, world: int, tmp: str, jobs: list) -> None:
    """One rank: join the gloo group, run `jobs` [(fn, kwargs)], rank 0 saves
    their results as JSON in `tmp` (mp.spawn returns nothing)."""
    torch.set_num_threads(1)  # ranks share the machine's cores: one each, as far as they go
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        results = [fn(rank, world, **kwargs) for fn, kwargs in jobs]
        gc.collect()  # free model/hook/handle cycles while the group lives (see tests' _worker)
        dist.barrier()  # no rank tears its connections down while a peer still uses them
    finally:
        dist.destroy_process_group()
    if rank == 0:
        harness.write_json(os.path.join(tmp, "results.json"), {"results": results})


def spawn_ranks(world: int, jobs: list) -> list:
    """Runs `jobs` in `world` spawned gloo ranks (file:// rendezvous in a temp
    dir, no network port); returns rank 0's results. A rank's exception is
    raised here by mp.spawn, with its traceback."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_main, args=(world, tmp, jobs), nprocs=world, join=True)
        with open(os.path.join(tmp, "results.json")) as f:
            return json.load(f)["results"]


def stats_summary(stats: dict[str, harness.Stats], baseline: str) -> dict:
    """Medians, spreads and the ratio of each candidate to `baseline` (> 1: faster)."""
    return {"ms": {n: s.median for n, s in stats.items()},
            "stats": {n: s.to_dict() for n, s in stats.items()},
            "speedup": {n: harness.speedup(stats[baseline].median, s.median)
                        for n, s in stats.items() if n != baseline}}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest |a - b| over all the named tensors of `a`."""
    return max(float((a[n] - b[n]).abs().max()) for n in a)


class DPCandidate:
    """One data-parallel candidate on this rank: a copy of the model, SGD with
    momentum, one full iteration on this rank's fixed batch. k None: torch's
    DistributedDataParallel; else reprop.ooo.data_parallel with that k."""

    def __init__(self, base: nn.Module, x: torch.Tensor, y: torch.Tensor, k, search_iters: int):
        self.model = copy.deepcopy(base)
        if k is None:
            self.dp = None
            self.forward = DistributedDataParallel(self.model, bucket_cap_mb=BUCKET_MB)
        else:
            self.dp = ooo.data_parallel(self.model, k=k, bucket_cap_mb=BUCKET_MB,
                                        search_iters=search_iters)
            self.forward = self.model  # not a wrapper: the model itself is called
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9)
        self.x, self.y = x, y

    def step(self) -> None:
        self.opt.zero_grad()
        models.cross_entropy(self.forward(self.x), self.y).backward()
        self.opt.step()

    def copy_state_from(self, other: "DPCandidate") -> None:
        """Parameters, buffers and momentum of `other`: from here on in lockstep."""
        self.model.load_state_dict(other.model.state_dict())  # copies into our parameters
        # Optimizer.load_state_dict keeps the tensors it is given (a shallow copy):
        # without the deepcopy both optimizers would update one momentum buffer
        self.opt.load_state_dict(copy.deepcopy(other.opt.state_dict()))

    def params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.model.named_parameters()}


def settle_search(c: DPCandidate) -> int:
    """Iterates `c` alone (its search times back-to-back iterations) until
    k="auto" settled; returns the iterations it took. Rank 0 broadcasts each
    decision, so every rank stops at the same iteration."""
    steps = 0
    while c.dp.searching:
        if steps == SEARCH_LIMIT:
            raise RuntimeError(f"data_parallel(k='auto'): search not settled in {steps} iterations")
        c.step()
        steps += 1
    return steps


def dp_job(rank: int, world: int, reps: int, warmup: int, search_iters: int) -> dict:
    """DDP against data_parallel k=0, k="auto", fixed k, alternated; then
    the parameters of every candidate against DDP's."""
    torch.manual_seed(0)  # the same model on every rank (both also broadcast rank 0's)
    base = models.build(DP_MODEL)
    x, y = models.make_batch(DP_MODEL, DP_BATCH, image_size=DP_IMAGE, seed=rank)  # rank's shard
    cands = {"DDP": DPCandidate(base, x, y, None, search_iters),
             "k=0": DPCandidate(base, x, y, 0, search_iters),
             "k=auto": DPCandidate(base, x, y, "auto", search_iters)}
    layers = len(cands["k=0"].dp.handle.sites)
    fixed = layers // 4  # about the paper's k = 45 of ResNet-50's 161 layers
    cands[f"k={fixed}"] = DPCandidate(base, x, y, fixed, search_iters)
    auto = cands["k=auto"]
    search_steps = settle_search(auto)
    # start the others from where the search left auto (instead of taking as
    # many steps each): from here every candidate takes the same steps
    for c in cands.values():
        if c is not auto:
            c.copy_state_from(auto)
    stats = harness.measure_alternated({n: c.step for n, c in cands.items()}, torch.device("cpu"),
                                       warmup=warmup, reps=reps)
    ref = cands["DDP"].params()
    equal = {n: harness.check_close(c.params(), ref, PARAM_RTOL, PARAM_ATOL)
             for n, c in cands.items() if n != "DDP"}
    return {"model": DP_MODEL, "image": DP_IMAGE, "batch_per_rank": DP_BATCH, "ranks": world,
            "bucket_cap_mb": BUCKET_MB, "layers": layers, "k": {n: c.dp.k for n, c in cands.items()
                                                                 if c.dp is not None},
            "search_iterations": search_steps, "search_iters_per_k": search_iters,
            "param_mismatch": equal,
            "max_abs_diff": {n: max_abs_diff(c.params(), ref) for n, c in cands.items() if n != "DDP"},
            **stats_summary(stats, "DDP")}


def pipe_layers() -> list[nn.Module]:
    """PIPE_LAYERS Linear + GELU blocks; the same on every rank and every call."""
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(PIPE_WIDTH, PIPE_WIDTH), nn.GELU()) for _ in range(PIPE_LAYERS)]


class PipeCandidate:
    """One pipeline candidate on this rank: its stage of a fresh copy of the
    layers, SGD with momentum over them, one training step on the batch."""

    def __init__(self, schedule: str, allocation: str, x: torch.Tensor, t: torch.Tensor):
        self.pipe = ooo.Pipeline(pipe_layers(), micro_batches=PIPE_MICRO, schedule=schedule,
                                 allocation=allocation)
        self.opt = torch.optim.SGD(list(self.pipe.parameters()), lr=1e-3, momentum=0.9)
        self.x, self.t = x, t

    def step(self) -> None:
        self.opt.zero_grad()
        self.pipe.step(self.x, self.t, F.mse_loss)
        self.opt.step()
        # a sample then spans every stage's whole step, not just this rank's part
        dist.barrier()

    def messages(self) -> int:
        """Point-to-point messages of the last step, all ranks together
        (Pipeline.messages counts what its rank sent; a collective call)."""
        count = torch.tensor([self.pipe.messages])
        dist.all_reduce(count)
        return int(count)

    def grads(self) -> dict[str, torch.Tensor]:
        """This rank's gradients, named as in the whole list of layers."""
        return {f"{l}.{n}": p.grad.clone() for l, layer in self.pipe.layers.items()
                for n, p in layer.named_parameters()}


class TorchPipeCandidate:
    """torch.distributed.pipelining's GPipe on this rank: the rank's contiguous stage of a fresh
    copy of the layers (PIPE_LAYERS / world each, as Pipeline's "contiguous"), SGD with momentum,
    loss_fn / M per micro-batch (torch's default scale_grads=True, Pipeline's convention)."""

    def __init__(self, rank: int, world: int, x: torch.Tensor, t: torch.Tensor):
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
        per = PIPE_LAYERS // world
        self.first, self.rank, self.world = rank * per, rank, world
        self.stage_layers = nn.Sequential(*pipe_layers()[self.first:self.first + per])
        stage = PipelineStage(self.stage_layers, rank, world, torch.device("cpu"))
        self.schedule = ScheduleGPipe(stage, n_microbatches=PIPE_MICRO, loss_fn=F.mse_loss)
        self.opt = torch.optim.SGD(self.stage_layers.parameters(), lr=1e-3, momentum=0.9)
        self.x, self.t = x, t

    def _pipe_step(self) -> None:
        if self.rank == 0:
            self.schedule.step(self.x)
        elif self.rank == self.world - 1:
            self.schedule.step(target=self.t)
        else:
            self.schedule.step()

    def step(self) -> None:
        self.opt.zero_grad()
        self._pipe_step()
        self.opt.step()
        dist.barrier()  # as PipeCandidate.step: a sample spans every stage's whole step

    def grads(self) -> dict[str, torch.Tensor]:
        """This rank's gradients, named as in the whole list of layers."""
        return {f"{self.first + i}.{n}": p.grad.clone() for i, layer in enumerate(self.stage_layers)
                for n, p in layer.named_parameters()}


def single_process_grads(x: torch.Tensor, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """The reference: the whole stack on the whole batch in one process."""
    net = nn.Sequential(*pipe_layers())
    F.mse_loss(net(x), t).backward()
    return {f"{l}.{n}": p.grad for l, layer in enumerate(net) for n, p in layer.named_parameters()}


def gather_grads(c: PipeCandidate, rank: int, world: int) -> dict[str, torch.Tensor] | None:
    """After one step from identical layers: every stage's gradients, on rank 0."""
    c.opt.zero_grad()
    if isinstance(c, TorchPipeCandidate):
        c._pipe_step()
    else:
        c.pipe.step(c.x, c.t, F.mse_loss)
    parts = [None] * world if rank == 0 else None
    dist.gather_object(c.grads(), parts, dst=0)
    return {n: g for part in parts for n, g in part.items()} if rank == 0 else None


def round_trip_ms(rank: int, shape: tuple[int, ...], reps: int = 20) -> float:
    """Median time for rank 0 to send a tensor to rank 1 and get it back, in
    ms: what a message between stages costs here (ranks 2.. wait)."""
    t = torch.zeros(shape)
    samples = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        elif rank == 1:
            dist.recv(t, 0)
            dist.send(t, 0)
        samples.append((time.perf_counter() - start) * 1e3)
    return harness.Stats.from_samples(samples).median


def pipe_job(rank: int, world: int, reps: int, warmup: int) -> dict:
    """GPipe contiguous against fast-forwarding contiguous and modulo, and
    torch's ScheduleGPipe: the gradients of one step first, then the step
    time, alternated."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(PIPE_BATCH, PIPE_WIDTH, generator=g)  # the same batch on every rank
    t = torch.randn(PIPE_BATCH, PIPE_WIDTH, generator=g)
    cands = {f"{s} {a}": PipeCandidate(s, a, x, t) for s, a in PIPE_CANDIDATES}
    cands[TORCH_GPIPE] = TorchPipeCandidate(rank, world, x, t)
    grads = {n: gather_grads(c, rank, world) for n, c in cands.items()}
    stats = harness.measure_alternated({n: c.step for n, c in cands.items()}, torch.device("cpu"),
                                       warmup=warmup, reps=reps)
    round_trip = round_trip_ms(rank, (PIPE_BATCH // PIPE_MICRO, PIPE_WIDTH))
    messages = {n: c.messages() for n, c in cands.items() if isinstance(c, PipeCandidate)}
    if rank != 0:
        return {}
    baseline = next(iter(cands))
    ref = single_process_grads(x, t)
    return {"ranks": world, "cpus": os.cpu_count(), "layers": PIPE_LAYERS, "width": PIPE_WIDTH,
            "batch": PIPE_BATCH, "micro_batches": PIPE_MICRO,
            "grad_mismatch_single": {n: harness.check_close(gr, ref, GRAD_RTOL, GRAD_ATOL)
                                     for n, gr in grads.items()},
            "grad_mismatch_gpipe": {n: harness.check_close(gr, grads[baseline], GRAD_RTOL, GRAD_ATOL)
                                    for n, gr in grads.items() if n != baseline},
            "max_abs_grad": max(float(v.abs().max()) for v in ref.values()),
            "simulated_speedup": simulated_pipeline_speedups(world),
            "messages_per_step": messages,
            "round_trip_ms": round_trip,
            "speedup_torch": {n: harness.speedup(stats[TORCH_GPIPE].median, s.median)
                              for n, s in stats.items() if n != TORCH_GPIPE},
            **stats_summary(stats, baseline)}


def simulated_pipeline_speedups(stages: int) -> dict[str, float]:
    """What the simulator predicts for the measured setting (unit costs, no
    transfer time): makespan of GPipe over each candidate's."""
    def makespan(schedule: str, allocation: str) -> float:
        order = "conventional" if schedule == "gpipe" else schedule
        return ooo.simulate(PIPE_LAYERS, num_stages=stages, micro_batches=PIPE_MICRO, order=order,
                            allocation=allocation).makespan
    base = makespan(*PIPE_CANDIDATES[0])
    return {f"{s} {a}": base / makespan(s, a) for s, a in PIPE_CANDIDATES[1:]}


def run_dist(args) -> dict:
    """Data parallel and pipeline on 2 ranks in one group of processes (one
    start-up), then the pipeline on 4 ranks (not with --quick). A failure is
    recorded with its traceback and the run goes on."""
    # at least 2 warm-up calls: DDP rebuilds its buckets after its first iteration
    reps, warmup = max(args.reps, 5), max(args.warmup, 2)
    out: dict = {}
    worlds = {2: [(dp_job, dict(reps=reps, warmup=warmup, search_iters=1 if args.quick else 3)),
                  (pipe_job, dict(reps=reps, warmup=warmup))]}
    if not args.quick:
        worlds[4] = [(pipe_job, dict(reps=reps, warmup=warmup))]
    for world, jobs in worlds.items():
        try:
            results = spawn_ranks(world, jobs)
        except Exception:  # noqa: BLE001 - report it with the rank's traceback, keep the rest
            err = traceback.format_exc()
            results = [{"ranks": world, "error": err}] * len(jobs)
        for (fn, _), res in zip(jobs, results):
            key = "dist_dp" if fn is dp_job else "dist_pipeline"
            out.setdefault(key, []).append(res)
    return out


def check_failed(out: dict) -> bool:
    """A single-device candidate differs from eager's, a rank failed or a result differs from its reference."""
    if any(m is not None for r in out.get("single", []) for m in r["mismatch"].values()):
        return True
    for res in out.get("dist_dp", []) + out.get("dist_pipeline", []):
        mismatches = {**res.get("param_mismatch", {}), **res.get("grad_mismatch_single", {}),
                      **res.get("grad_mismatch_gpipe", {})}
        if "error" in res or any(m is not None for m in mismatches.values()):
            return True
    return False


def yes_or_why(mismatches: dict) -> str:
    """"yes" when no candidate has a mismatch, else each one's message."""
    bad = {n: m for n, m in mismatches.items() if m is not None}
    return "yes" if not bad else "NO: " + "; ".join(f"{n}: {m}" for n, m in bad.items())


def print_dist(out: dict) -> None:
    cpus = os.cpu_count()
    print(f"\nDistributed, measured: CPU processes with gloo on this machine's {cpus} cores, one "
          "torch thread per rank. The ranks share the cores (gloo's communication runs on them "
          "too): this measures the schedules' overhead and correctness, not the GPU speedup.")
    for r in out.get("dist_dp", []):
        print_dist_dp(r)
    for r in out.get("dist_pipeline", []):
        print_dist_pipeline(r)


def print_dist_dp(r: dict) -> None:
    if "error" in r:
        print(f"\nData parallel, {r['ranks']} ranks: FAILED\n{r['error']}")
        return
    print(f"\nData parallel, {r['ranks']} ranks, {r['model']} at {r['image']}x{r['image']}, batch "
          f"{r['batch_per_rank']} per rank, SGD momentum 0.9, bucket_cap_mb {r['bucket_cap_mb']:g} "
          f"(DDP and ours); {r['layers']} split layers; ms per iteration (zero_grad, forward, loss, "
          f"backward, step), median of {len(r['stats']['DDP']['samples'])}, rank 0")
    print(f"k=auto settled at k={r['k']['k=auto']} after {r['search_iterations']} iterations "
          f"({r['search_iters_per_k']} per k)")
    print(harness.format_table(
        ["candidate", "k", "DDP ms", "ours ms", "x DDP", "max |param - DDP's|"],
        [[f"data_parallel {n}", r["k"][n], harness.fmt(r["ms"]["DDP"], ".1f"),
          harness.fmt(r["ms"][n], ".1f"), harness.fmt(r["speedup"][n], ".3f"),
          harness.fmt(r["max_abs_diff"][n], ".2g")] for n in r["speedup"]]))
    print(f"parameters equal to DDP: {yes_or_why(r['param_mismatch'])}")


def print_dist_pipeline(r: dict) -> None:
    if "error" in r:
        print(f"\nPipeline, {r['ranks']} ranks: FAILED\n{r['error']}")
        return
    over = (f"; OVERSUBSCRIBED: {r['ranks']} ranks on {r['cpus']} cores, stages wait for a core"
            if r["ranks"] > (r["cpus"] or 1) else "")
    print(f"\nPipeline, {r['ranks']} ranks, {r['layers']} x (Linear {r['width']} + GELU), batch "
          f"{r['batch']} in {r['micro_batches']} micro-batches, MSE, SGD momentum 0.9; ms per step "
          f"(zero_grad, step, optimizer step, barrier), median of "
          f"{len(next(iter(r['stats'].values()))['samples'])}, rank 0{over}")
    base = next(n for n in r["ms"] if n not in r["speedup"])
    torch_x = r.get("speedup_torch", {})
    print(harness.format_table(
        ["candidate", "GPipe ms", "ours ms", "x GPipe", "x torch GPipe", "simulated x", "messages",
         "GPipe messages"],
        [[n, harness.fmt(r["ms"][base], ".1f"), harness.fmt(r["ms"][n], ".1f"),
          harness.fmt(r["speedup"][n], ".3f"), harness.fmt(torch_x.get(n), ".3f"),
          harness.fmt(r["simulated_speedup"].get(n), ".3f"),
          harness.fmt(r["messages_per_step"].get(n)), r["messages_per_step"][base]] for n in r["speedup"]]))
    print(f"GPipe = reprop's Pipeline(schedule=\"gpipe\"), the rows' baseline; {TORCH_GPIPE} = "
          "torch.distributed.pipelining.ScheduleGPipe on the same contiguous stages, torch's peer "
          f"(its row's x GPipe = GPipe ms / its ms; x torch GPipe = {TORCH_GPIPE} ms / the row's)")
    print(f"simulated x: unit task times, no transfer time (the paper's NVLink regime); messages: "
          f"point-to-point per step (reprop's Pipeline counts them); a round trip of one micro-batch's "
          f"activation between two ranks takes {r['round_trip_ms']:.2f} ms here")
    print(f"gradients after one step equal to single-process training's (rtol {GRAD_RTOL:g}, largest "
          f"|grad| {r['max_abs_grad']:.2g}): {yes_or_why(r['grad_mismatch_single'])}; "
          f"to GPipe's: {yes_or_why(r['grad_mismatch_gpipe'])}")


def main() -> None:
    parser = harness.make_parser(__doc__.splitlines()[0])
    parser.add_argument("--parts", default=None,
                        help="comma-separated: single, split, simulate, dist (default: all four on "
                             "the CPU, single, split and simulate on CUDA)")
    parser.add_argument("--models", type=lambda s: s.split(","), default=FULL_MODELS)
    parser.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[32, 64])
    args = parser.parse_args()
    device = harness.setup_device(args)
    args.reps = args.reps or (3 if args.quick else 10)
    args.warmup = args.warmup if args.warmup is not None else 1
    parts = (args.parts or ("single,split,simulate,dist" if device.type == "cpu"
                            else "single,split,simulate")).split(",")
    out = {"machine": harness.machine_info(device)}
    print(harness.describe_machine(out["machine"]))
    if "single" in parts:
        out["single"] = run_single(args, device)
        print_single(out["single"])
    if "split" in parts:
        out["split"] = run_split(args, device)
        print_split(out["split"])
    if "simulate" in parts:
        gpus = [16] if args.quick else [16, 32, 48]
        cases = [(16, 4, 4)] if args.quick else [(16, 4, 4), (24, 8, 8), (48, 16, 16), (48, 24, 24),
                                                 (96, 32, 32)]
        out["simulate_dp"] = simulate_data_parallel(gpus)
        out["simulate_pipeline"] = simulate_pipeline(cases)
        print_simulation(out["simulate_dp"], out["simulate_pipeline"])
    if "dist" in parts:
        out.update(run_dist(args))
        print_dist(out)
    harness.write_json(args.json, out)
    harness.exit_if_failed(check_failed(out))


if __name__ == "__main__":
    main()
