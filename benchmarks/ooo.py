"""Benchmark reprop.ooo (out-of-order backprop) against eager PyTorch.

Parts (--parts, default all that run on the device):

  single    one device, the user's unchanged loop (SGD with momentum, as the
            paper reports), synthetic data; candidates alternated in one run:
              eager         plain PyTorch
              graph         the whole step captured in one CUDA graph (CUDA only)
              ooo           reprop.ooo.enable(model): dW deferred, on CUDA on a
                            low-priority sub-stream, placed by Algorithm 1
              ooo+graph     the same, captured in one CUDA graph (CUDA only)
            throughput (images/s) and peak memory per candidate, and the gain
            of each part as the paper's Figure 7 (graph over eager, ooo+graph
            over graph). Models after the paper: DenseNet-121 (growth 12, 24,
            32), MobileNetV3-Large (width 0.25 to 1.0), ResNet-50; batch 32, 64.
  simulate  the scheduler core's simulator with the paper's settings:
            data parallel ResNet-50 on 16, 32, 48 GPUs over 10 Gb/s
            (conventional with FIFO all-reduce, prioritised all-reduce as
            BytePS, reverse first-k with k searched as in Section 5.1), next
            to the paper's 1.10-1.27x; pipeline BERT-48-like stacks (GPipe,
            fast-forwarding, + modulo allocation) next to 1.41-1.99x.

    python benchmarks/ooo.py --quick                   # CPU: small single part + simulate
    python benchmarks/ooo.py --device cuda --json out.json
"""

from __future__ import annotations

import copy
import os
import sys

import torch
from torch import nn

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
        with torch.cuda.stream(side):
            for _ in range(max(3, self.handle.profile_iters + 1 if self.handle else 3)):
                self._eager_step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._eager_step()

    def step(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self._eager_step()


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
            trainers, errors = {}, {}
            for label, (use_ooo, graph) in kinds.items():
                try:
                    trainers[label] = Trainer(base, x, y, use_ooo, graph)
                except Exception as exc:  # report, do not hide: e.g. what capture refused
                    errors[label] = f"{type(exc).__name__}: {exc}"[:120]
            for t in trainers.values():  # past the ooo profile: the fixed schedule is timed
                for _ in range(4):
                    t.step()
            stats = harness.measure_alternated({k: t.step for k, t in trainers.items()}, device,
                                               warmup=args.warmup, reps=args.reps)
            peaks = {}
            for label, t in trainers.items():
                peaks[label] = harness.peak_memory(t.step, device)
            row = {"model": name, "batch": batch, "errors": errors,
                   "ms": {k: s.median for k, s in stats.items()},
                   "images_per_s": {k: batch / (s.median / 1e3) for k, s in stats.items()},
                   "peak_bytes": peaks,
                   "schedule": trainers["ooo"].handle.schedule if "ooo" in trainers else None}
            rows.append(row)
            del trainers
            if cuda:
                torch.cuda.empty_cache()
    return rows


def print_single(rows: list[dict]) -> None:
    labels = ["eager", "graph", "ooo", "ooo+graph"]
    headers = ["model", "batch"] + [f"{l} img/s" for l in labels] + \
              ["graph/eager", "ooo/eager", "ooo+graph/graph", "ooo+graph/eager", "extra peak"]
    table = []
    for r in rows:
        ips = r["images_per_s"]

        def ratio(a, b):
            return ips[a] / ips[b] if a in ips and b in ips else None

        peak = r["peak_bytes"]
        extra = None
        if peak.get("ooo+graph") and peak.get("graph"):
            extra = peak["ooo+graph"] / peak["graph"] - 1
        elif peak.get("ooo") and peak.get("eager"):
            extra = peak["ooo"] / peak["eager"] - 1
        table.append([r["model"], r["batch"]] + [harness.fmt(ips.get(l), ".1f") for l in labels] +
                     [harness.fmt(ratio("graph", "eager"), ".3f"), harness.fmt(ratio("ooo", "eager"), ".3f"),
                      harness.fmt(ratio("ooo+graph", "graph"), ".3f"),
                      harness.fmt(ratio("ooo+graph", "eager"), ".3f"),
                      "n/a" if extra is None else f"{extra * 100:+.1f}%"])
    print(harness.format_table(headers, table))
    for r in rows:
        for label, err in r["errors"].items():
            print(f"  {r['model']} b{r['batch']} {label}: {err}")


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


def simulate_data_parallel(gpus: list[int]) -> list[dict]:
    """ResNet-50 data parallel, the paper's Section 8.3 discussion: 380 ms of
    computation per iteration (forward, dO, dW in equal parts, split over the
    layers by their multiply-adds), 10 Gb/s between nodes, ring all-reduce."""
    share, sizes = layer_profile(models.build("resnet50"))
    compute = 0.380
    per = [compute / 3 * s for s in share]
    rows = []
    for n in gpus:
        sync = [ooo.allreduce_time(b, n, 10e9 / 8, 25e-6) for b in sizes]
        common = dict(fwd=per, out_grad=per, weight_grad=per, sync=sync, iterations=2)
        layers = len(per)
        fifo = ooo.simulate(layers, sync_by_layer=False, **common).period
        prio = ooo.simulate(layers, **common).period
        k, _ = ooo.search_k(layers, lambda k: 1.0 / ooo.simulate(
            layers, order="reverse_first_k", k=k, **common).period)
        ours = ooo.simulate(layers, order="reverse_first_k", k=k, **common).period
        rows.append({"gpus": n, "layers": layers, "fifo_ms": fifo * 1e3, "priority_ms": prio * 1e3,
                     "reverse_first_k_ms": ours * 1e3, "k": k,
                     "speedup_over_priority": prio / ours, "speedup_over_fifo": fifo / ours})
    return rows


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


def print_simulation(dp: list[dict], pipe: list[dict]) -> None:
    print("\nData parallel, ResNet-50, simulated (paper: 1.10-1.27x over BytePS on 16-48 GPUs)")
    print(harness.format_table(
        ["GPUs", "FIFO ms", "prioritised ms", "reverse first-k ms", "k", "x prioritised", "x FIFO"],
        [[r["gpus"], harness.fmt(r["fifo_ms"], ".1f"), harness.fmt(r["priority_ms"], ".1f"),
          harness.fmt(r["reverse_first_k_ms"], ".1f"), r["k"],
          harness.fmt(r["speedup_over_priority"], ".3f"), harness.fmt(r["speedup_over_fifo"], ".3f")]
         for r in dp]))
    print("\nPipeline, uniform layers, simulated (paper: OOO-Pipe2 1.41-1.99x over GPipe)")
    print(harness.format_table(
        ["layers", "GPUs", "micro", "GPipe", "fast-fwd", "+modulo", "ff x", "modulo x"],
        [[r["layers"], r["gpus"], r["micro_batches"], harness.fmt(r["gpipe"], ".1f"),
          harness.fmt(r["fast_forward"], ".1f"), harness.fmt(r["modulo"], ".1f"),
          harness.fmt(r["ff_speedup"], ".3f"), harness.fmt(r["modulo_speedup"], ".3f")]
         for r in pipe]))


def main() -> None:
    parser = harness.make_parser(__doc__.splitlines()[0])
    parser.add_argument("--parts", default="single,simulate")
    parser.add_argument("--models", type=lambda s: s.split(","), default=FULL_MODELS)
    parser.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[32, 64])
    args = parser.parse_args()
    device = harness.setup_device(args)
    args.reps = args.reps or (3 if args.quick else 10)
    args.warmup = args.warmup if args.warmup is not None else 1
    parts = args.parts.split(",")
    out = {"machine": harness.machine_info(device)}
    print(harness.describe_machine(out["machine"]))
    if "single" in parts:
        out["single"] = run_single(args, device)
        print_single(out["single"])
    if "simulate" in parts:
        gpus = [16] if args.quick else [16, 32, 48]
        cases = [(16, 4, 4)] if args.quick else [(16, 4, 4), (24, 8, 8), (48, 16, 16), (48, 24, 24),
                                                 (96, 32, 32)]
        out["simulate_dp"] = simulate_data_parallel(gpus)
        out["simulate_pipeline"] = simulate_pipeline(cases)
        print_simulation(out["simulate_dp"], out["simulate_pipeline"])
    harness.write_json(args.json, out)


if __name__ == "__main__":
    main()
