"""Shared benchmark harness for reprop: timing, alternation, ratios, bandwidth, reporting.

Every benchmark script (benchmarks/<technique>.py) follows the same recipe:

    parser = make_parser("what it measures")       # --device --quick --reps --warmup --threads --json
    args = parser.parse_args(); device = setup_device(args)
    stats = measure_alternated({"torch": f, "reprop": g, "copy": make_bandwidth_probe(nbytes, device)}, device)
    ratio = speedup(stats["torch"].median, stats["reprop"].median)   # > 1: reprop faster
    peak = peak_memory(step, device, setup=build)   # bytes held at the peak of step() (CUDA or CPU)
    print(format_table(headers, rows)); write_json(args.json, {..., "machine": machine_info(device)})
    exit_if_failed(failed)   # last: status 1 when a correctness check (a WARNING line) failed

Timing rules, and why:
  * CPU samples use time.perf_counter (or a clock given, such as
    time.thread_time for host costs on a shared machine); CUDA samples use a pair of CUDA events
    around the calls and wait for the end event, so GPU work is counted and
    host-side launch overhead is counted too when it dominates (it is real cost).
  * Candidates are measured alternately, one sample of each in turn, so slow
    drift (clock boost, thermal, other tenants) hits all of them alike; the
    starting candidate rotates every round so none always runs right after the
    same neighbour (which would leave it the same cache and queue state).
  * The median of the samples is the headline figure; min, max and the
    quartiles show the spread.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import json
import math
import os
import platform
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass
from typing import Callable, Mapping, Sequence

import torch

# ---------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------


@dataclass
class Stats:
    """Summary of timing samples, in milliseconds per call."""

    median: float
    min: float
    max: float
    q1: float
    q3: float
    samples: list[float]

    @classmethod
    def from_samples(cls, samples: Sequence[float]) -> "Stats":
        """Summarise a non-empty list of per-call times (ms)."""
        s = sorted(samples)
        if len(s) >= 2:
            q1, _, q3 = statistics.quantiles(s, n=4, method="inclusive")
        else:
            q1 = q3 = s[0]
        return cls(statistics.median(s), s[0], s[-1], q1, q3, list(samples))

    @property
    def iqr(self) -> float:
        """Inter-quartile range (ms): the spread of the middle half of the samples."""
        return self.q3 - self.q1

    def to_dict(self) -> dict:
        """JSON-ready dict, including the IQR."""
        return {**asdict(self), "iqr": self.iqr}


# ---------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    """Wait for all queued work on ``device`` (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], device: torch.device, inner: int = 1,
              clock: Callable[[], float] | None = None) -> float:
    """Time ``inner`` back-to-back calls of ``fn``; return milliseconds per call.

    On CUDA the events are recorded on the current stream, which is the stream
    torch ops and reprop's kernels are launched on. On the CPU ``clock`` (seconds;
    default time.perf_counter) reads the time: time.thread_time counts only what
    the thread ran, not the time it waited while preempted on a shared machine.
    """
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        synchronize(device)  # start from an empty queue, so earlier work isn't counted
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / inner
    clock = clock or time.perf_counter
    t0 = clock()
    for _ in range(inner):
        fn()
    return (clock() - t0) * 1e3 / inner


def choose_inner(fns: Sequence[Callable[[], object]], device: torch.device,
                 min_sample_ms: float, max_inner: int = 1000) -> int:
    """Calls per sample so that the fastest of ``fns`` takes at least ``min_sample_ms``.

    One shared count for all candidates, so each runs the same number of calls
    (and optimizers end after the same number of steps). Tiny CUDA steps need
    this: a single call of a few microseconds is near the event resolution.
    """
    if min_sample_ms <= 0:
        return 1
    for fn in fns:  # untimed first: lazy kernel loading, first-touch page faults
        fn()
    fastest = min(time_call(fn, device) for fn in fns)
    if fastest <= 0:
        return max_inner
    return max(1, min(max_inner, int(min_sample_ms / fastest + 0.999)))


def measure_alternated(candidates: Mapping[str, Callable[[], object]], device: torch.device,
                       warmup: int = 2, reps: int = 10, inner: int = 1,
                       clock: Callable[[], float] | None = None) -> dict[str, Stats]:
    """Measure several candidates in alternation; return ``{name: Stats}``.

    ``warmup`` untimed calls of each (lazy state allocation, caches, clocks),
    then ``reps`` rounds; round r times one sample of every candidate, starting
    from candidate r mod n (A B C, B C A, C A B, ...). Each sample is ``inner``
    calls (see choose_inner), timed with ``clock`` on the CPU (see time_call).
    """
    names = list(candidates)
    for name in names:
        for _ in range(warmup):
            candidates[name]()
    synchronize(device)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(reps):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            samples[name].append(time_call(candidates[name], device, inner, clock))
    return {name: Stats.from_samples(s) for name, s in samples.items()}


def measure(fn: Callable[[], object], device: torch.device, warmup: int = 2, reps: int = 10,
            inner: int = 1) -> Stats:
    """Measure a single callable (measure_alternated with one candidate)."""
    return measure_alternated({"fn": fn}, device, warmup, reps, inner)["fn"]


# ---------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------

PEAK_MARKER = "harness.peak_memory"


def peak_memory(fn: Callable[[], object], device: torch.device,
                setup: Callable[[], object] | None = None) -> int | None:
    """Peak bytes held by torch's allocator while ``fn()`` runs, counted from before ``setup()``.

    Memory already held when the call starts does not count; what ``setup()``
    allocates and still holds when ``fn()`` starts does (e.g. setup builds a
    model and takes warm-up steps, fn takes the step to measure: the result is
    that step's peak including the model, its optimizer state and anything
    kept between steps). Returns None when the device gives no measure.

    CUDA: the caching allocator's own counters (memory_allocated, and
    max_memory_allocated after reset_peak_memory_stats), exact.
    CPU: torch keeps no counter for its CPU allocator (and tracemalloc does
    not see it), but the profiler with profile_memory=True records each of its
    allocations and frees as a "[memory]" event with a signed size; the peak
    is the largest running sum, in time order, within ``fn()``, starting from
    what is held when ``fn()`` starts (as CUDA's counters do). Memory taken
    outside torch's allocator (oneDNN scratch pads, Python objects) is not
    seen. The profiler slows the calls down: never time under it.
    """
    if device.type == "cuda":
        synchronize(device)
        base = torch.cuda.memory_allocated(device)
        if setup is not None:
            setup()
            synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    if device.type != "cpu":
        return None
    from torch.profiler import ProfilerActivity, profile, record_function
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        if setup is not None:
            setup()
        with record_function(PEAK_MARKER):
            fn()
    return _cpu_peak_from_events(prof.profiler.kineto_results.events())


def _cpu_peak_from_events(events) -> int | None:
    """Largest running sum of CPU "[memory]" event sizes inside the PEAK_MARKER range, the sum held
    when the range starts included."""
    marker = next((e for e in events if e.name() == PEAK_MARKER), None)
    memory = sorted((e.start_ns(), e.nbytes()) for e in events
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    if marker is None or not memory:
        return None
    held = 0
    peak = None  # set when fn() starts: what is held then counts, as on CUDA (see below)
    for t, nbytes in memory:
        if t > marker.end_ns():
            break
        if t >= marker.start_ns() and peak is None:
            # What setup() left held is part of the step's peak (CUDA's reset_peak_memory_stats
            # leaves the peak at what is allocated). Taken over fn()'s events alone, a step whose
            # first event is a free, or that allocates nothing, peaked below what it started with.
            peak = max(0, held)
        held += nbytes
        if peak is not None:
            peak = max(peak, held)
    return max(0, held) if peak is None else peak


# ---------------------------------------------------------------------------
# Ratios and bandwidth
# ---------------------------------------------------------------------------


def speedup(peer_ms: float, ours_ms: float) -> float:
    """peer time / reprop time: > 1 means reprop is faster."""
    return peer_ms / ours_ms


def gbps(nbytes: float, ms: float) -> float:
    """Achieved bandwidth in GB/s (10^9 bytes per second) for ``nbytes`` moved in ``ms``."""
    return nbytes / (ms * 1e-3) / 1e9


PROBES = ("copy", "inplace")


def make_bandwidth_probe(bytes_moved: int, device: torch.device, kind: str = "copy") -> Callable[[], object]:
    """A streaming torch op whose counted read + write traffic is ``bytes_moved`` bytes.

    It is the practical memory-bandwidth limit for a kernel of the same
    traffic: time it alongside the kernel (in the same alternation) and compare
    ``gbps(bytes_moved, ...)``. Buffers are float32: the copy probe's together
    are as large as the traffic, the inplace probe's 2/3 of it. A kernel that
    reads and writes the same arrays touches less than its traffic (AdamW's
    p, g, m, v: 16 B per parameter for 28 B of traffic, 4/7; SGD's p, g, buf:
    12 B for 20 B, 3/5), so the probes' working sets are larger than the
    kernel's (for AdamW 1.75x and 1.17x): only when both are far beyond the
    last-level cache (or both well inside it) do they meet the same memory
    level. Size the kernel's case for that.

    kind "copy":    ``dst.copy_(src)``, read src + write dst (8 B per element).
                    The classic probe. On CPUs a store to a line not in cache
                    first reads it (write-allocate), so the copy really moves
                    ~1.5x what is counted, and it under-states the limit for
                    kernels that only write what they have just read.
    kind "inplace": ``a.add_(b)``, read a and b + write a (12 B per element):
                    read-only and read-modify-write streams, the pattern of
                    in-place updates such as optimizer steps, with no
                    write-allocate traffic.
    """
    if kind == "copy":
        src = torch.rand(max(1, bytes_moved // 8), device=device)
        dst = torch.empty_like(src)
        return lambda: dst.copy_(src)
    if kind == "inplace":
        a = torch.rand(max(1, bytes_moved // 12), device=device)
        b = torch.rand_like(a)
        return lambda: a.add_(b)
    raise ValueError(f"kind must be one of {PROBES}, got {kind!r}")


# ---------------------------------------------------------------------------
# Correctness checks: a wrong candidate is also "fast", so every benchmark compares results
# ---------------------------------------------------------------------------


def check_close(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor], rtol: float,
                atol: float | Mapping[str, float]) -> str | None:
    """None when every tensor of ``got`` is close to ``want``'s, else why not.

    Element-wise, torch.testing.assert_close's rule |got - want| <= atol + rtol |want|
    (rtol = atol = 0: bitwise). ``atol`` may be given per tensor name, for
    tolerances in units of each tensor's own scale.
    """
    if set(got) != set(want):
        return f"different tensors: {sorted(set(got) ^ set(want))[:5]}"
    try:
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=rtol,
                                       atol=atol[n] if isinstance(atol, Mapping) else atol,
                                       msg=lambda m, n=n: f"{n}: {m}")
    except AssertionError as exc:
        return str(exc)
    return None


def within(error: float | None, tolerance: float) -> bool:
    """Whether a measured error passes its tolerance; None (not measured: a candidate n/a) passes, NaN fails."""
    return error is None or error <= tolerance


def print_check(what: str, problems: Sequence[str]) -> None:
    """A correctness check's report: a WARNING line per problem, then ``what`` and ok (or not)."""
    for problem in problems:
        print(f"WARNING: {problem}")
    print(f"{what}: {'WARNING, see above' if problems else 'ok'}", flush=True)


def exit_if_failed(failed: bool) -> None:
    """End the run with exit status 1 when one of its correctness checks failed.

    Called last, once the report (each failure a WARNING line) is printed and
    the JSON written: the figures stay, and a script or CI sees the failure
    as a reader of the WARNING does. A wrong candidate is also "fast".
    """
    if failed:
        raise SystemExit(1)


def release(device: torch.device) -> None:
    """Free what the last measurement left, so the next starts alike (a
    reference cycle, such as a model, its hooks and a handle of reprop's,
    is freed only by the collector; on CUDA, the cached blocks too)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def reproducible():
    """A context for a correctness check's computations: on CUDA, cuDNN's deterministic algorithms
    and no TF32 (the CPU is not affected).

    cuDNN may sum in any order (atomics), run to run, and by default rounds the
    inputs of its fp32 convolutions and RNNs to TF32's 10 bits: either puts a
    gradient far beyond fp32 rounding from the same computation elsewhere (a
    reference, a candidate stepped alike). CUDA ops outside cuDNN that use
    atomics (torch.use_deterministic_algorithms' list) are not covered.
    """
    return torch.backends.cudnn.flags(enabled=torch.backends.cudnn.enabled, deterministic=True, allow_tf32=False)


def relative_error(got: torch.Tensor, want: torch.Tensor, scale: float | None = None) -> float:
    """max |got - want| / ``scale`` (default max |want|): the largest error in units of the reference's size.

    0 when equal, inf when the scale is 0 but they differ or a NaN is met (max() would drop it).
    """
    diff = float((got.float() - want.float()).abs().max())
    if math.isnan(diff):
        return float("inf")
    if scale is None:
        scale = float(want.float().abs().max())
    return diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))


# ---------------------------------------------------------------------------
# Command line and device
# ---------------------------------------------------------------------------


def make_parser(description: str) -> argparse.ArgumentParser:
    """An ArgumentParser with the options every benchmark shares.

    --device cpu|cuda, --quick (CI-sized), --reps, --warmup (defaults chosen by
    the script from --quick when left unset), --threads (CPU threads for torch
    and reprop), --json PATH.
    """
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where to run (default: cpu)")
    p.add_argument("--quick", action="store_true", help="CI-sized run (fewer repetitions; each script says what it trims)")
    p.add_argument("--reps", type=int, default=None, help="timed rounds per candidate (median over these)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls per candidate before timing")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads before running (reprop follows torch's count)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON to PATH")
    return p


def setup_device(args: argparse.Namespace) -> torch.device:
    """Apply --threads and check that --device is usable; return the torch.device."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False on this machine")
    return torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")


# ---------------------------------------------------------------------------
# Machine description
# ---------------------------------------------------------------------------


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (platform.processor() elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_commit(path: str | None = None) -> str | None:
    """HEAD of the git repository containing ``path`` (this file by default), "+dirty" if modified."""
    cwd = path or os.path.dirname(os.path.abspath(__file__))

    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=cwd, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short=12", "HEAD")
    except (OSError, subprocess.SubprocessError):
        return None  # not a checkout, no git, or no commit yet
    try:
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        dirty = False
    return head + ("+dirty" if dirty else "")


def reprop_info() -> dict:
    """reprop's version and build (OpenMP, CUDA archs), or why it could not be imported.

    Read defensively: beyond __version__ and cuda_available(), the attributes
    and native modules' build_info() are optional, so the harness works with
    any build of the package.
    """
    try:
        import reprop
    except Exception as e:  # noqa: BLE001 - a broken build should be reported, not crash the run
        return {"importable": False, "error": f"{type(e).__name__}: {e}"}
    info: dict = {"importable": True, "version": getattr(reprop, "__version__", None),
                  "path": os.path.dirname(getattr(reprop, "__file__", "") or "")}
    for name in ("cuda_built", "cuda_available"):
        try:
            info[name] = bool(getattr(reprop, name)())
        except Exception as e:  # noqa: BLE001
            info[name] = f"error: {type(e).__name__}: {e}"
    for ext in ("_C", "_cuda"):  # the native extensions, when present
        try:
            info[f"{ext}_build"] = importlib.import_module(f"reprop.{ext}").build_info()
        except Exception:  # noqa: BLE001 - not built (e.g. no CUDA) or no build_info
            pass
    return info


def machine_info(device: torch.device) -> dict:
    """What ran the benchmark: CPU, threads, GPU, versions, git commit, date."""
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "device": str(device),
        # Load before the run: a busy machine (other jobs) makes figures noisy, and on CPUs it
        # stalls every OpenMP barrier of multi-threaded ops while a thread waits to be scheduled.
        "loadavg_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "git_commit": git_commit(),
        "reprop": reprop_info(),
    }
    if device.type == "cuda":
        prop = torch.cuda.get_device_properties(device)
        info["gpu"] = prop.name
        info["gpu_memory_gib"] = round(prop.total_memory / 2**30, 1)
        info["gpu_capability"] = f"sm_{prop.major}{prop.minor}"
    return info


def describe_machine(info: dict) -> str:
    """Two human-readable lines summarising machine_info()."""
    rp = info["reprop"]
    if rp.get("importable"):
        builds = "; ".join(f"{k[:-len('_build')]} {v}" for k, v in rp.items() if k.endswith("_build"))
        rp_text = (f"reprop {rp.get('version')} (cuda_built={rp.get('cuda_built')}, "
                   f"cuda_available={rp.get('cuda_available')}{'; ' + builds if builds else ''})")
    else:
        rp_text = f"reprop not importable ({rp['error']})"
    line1 = (f"{info['cpu']}, {info['cpu_count']} CPUs, torch threads {info['torch_threads']}; "
             f"python {info['python']}, torch {info['torch']}")
    if "gpu" in info:
        line1 += (f"; {info['gpu']} ({info['gpu_capability']}, {info['gpu_memory_gib']} GiB), "
                  f"CUDA {info['torch_cuda']}")
    text = f"{line1}\n{rp_text}; git {info['git_commit'] or 'n/a'}; {info['date']}"
    checkout = os.path.realpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir,
                                             "python", "reprop"))
    if rp.get("importable") and os.path.realpath(rp.get("path") or "") != checkout:
        # an older `pip install .` shadows the checkout: the git line would lie
        text += (f"\nWARNING: reprop was imported from {rp.get('path')}, not from this checkout "
                 f"({checkout}): the figures are for that build, not for git "
                 f"{info['git_commit'] or 'n/a'} (pip install -e ., or PYTHONPATH=python)")
    load, cpus = info.get("loadavg_1min"), info.get("cpu_count") or 1
    if load is not None and load > 0.25 * cpus + 0.5:
        text += (f"\nWARNING: load average {load:.1f} on {cpus} CPUs before the run: other "
                 "processes are busy, figures will be noisy")
    return text


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------


def fmt(value: object, spec: str = ".3g") -> str:
    """Format a table cell: numbers with ``spec``, None as "-", anything else with str()."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table; cells are str()-ed (pre-format numbers with fmt()).

    Columns are right-aligned except the first, which usually names the case.
    """
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])


def format_markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """The rows as a markdown table, RESULTS.md's style; cells are str()-ed, their pipes escaped."""
    def line(row: Sequence[object]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |"

    return "\n".join([line(headers), line(["---"] * len(headers))] + [line(r) for r in rows])


def write_json(path: str | None, payload: dict) -> None:
    """Write ``payload`` as indented JSON to ``path`` (nothing when path is None)."""
    if path is None:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)
        f.write("\n")
