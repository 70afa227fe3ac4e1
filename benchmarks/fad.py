"""Benchmark reprop's nested forward-AD activations (reprop.fad) against torch's native,
composed and checkpointed activations.

Two parts (--parts):

steps: one training step of a model on synthetic data (models.make_batch), fp32 or,
with --amp, under torch.autocast(bfloat16):

    loss = cross_entropy(model(x), y); loss.backward(); SGD(lr 1e-4).step(); zero_grad(set_to_none)

Models (models.py): ResNet-50 with Swish, Mish and tanh-GELU, and BERT-base for
sequence classification (sequence 128) with GELU (erf, BERT's own) and tanh-GELU.
Candidates, each training its own copy of the same initial model:

    native               torch's module (nn.SiLU, nn.Mish, nn.GELU): saves one x-sized tensor
    composed             the formula written out with torch ops (models.ComposedSwish, ...):
                         autograd saves 2 (Swish, Mish), 3 (erf GELU) or 4 (tanh GELU) tensors
    checkpointed         the composed module under torch.utils.checkpoint (non-reentrant):
                         saves x, recomputes the chain in backward
    reprop patch         reprop.fad.patch(native model): saves f'(x) in x's dtype
    reprop patch bf16    ... saved_dtype=torch.bfloat16
    reprop patch u8      ... saved_dtype=torch.uint8 (8-bit codes of f'(x))
    reprop compose       the composed model's forward (and loss) inside
                         reprop.fad.enabled(compose=True): each chain saves one derivative
    reprop compose bf16  ... enabled(compose=True, saved_dtype=torch.bfloat16)

Measured per candidate:

  * bytes saved for backward by one forward and still held when it ends (the
    loss computed), counted with torch.autograd.graph.saved_tensors_hooks: the
    pack hook records each saved tensor's whole storage and wraps it in an
    object whose weak reference says whether autograd still holds that slot at
    the end (reprop's compose mode saves a derivative per chain step and frees
    the steps' nodes as the intermediates die); counted once per storage
    (aliases and views are not counted twice), leaving out the parameters' and
    the input batch's storages (they exist anyway) and 0-dim/one-element tensors
    (scalars autograd keeps). "saved" is the whole model's.
    "act" is what the activations add: saved(model) - saved(the same model with
    every activation module replaced by nn.Identity), same batch and precision.
    Under Identity the activation's consumer (conv, Linear, pool) saves x; with the
    activation it saves y instead, so the difference is exactly the bytes the
    activation keeps beyond its output (for SiLU/Mish/GELU, which save x: one
    x-sized tensor). "x" expresses act in units of the activations' inputs
    (summed over the calls, in the dtype the activations receive); "tensors" is
    the difference in the number of saved storages per activation call.
  * peak memory of one steady-state step (after one warm-up step; model, gradients
    and transients): harness.peak_memory, one candidate alive at a time. CUDA:
    the allocator's counters; CPU: the profiler's allocation events.
  * step time (forward + backward + SGD step + zero_grad), all candidates
    alternated in the same run (harness.measure_alternated), medians; "x native"
    = native ms / candidate ms and "x ckpt" = checkpointed ms / candidate ms
    (> 1: the candidate is faster).
  * CUDA only: the largest batch whose step fits under --mem-cap-gib, found by
    doubling then bisection on the batch size (one model per candidate for the
    whole search), where a batch fits when the peak of its second step
    (torch.cuda.max_memory_allocated, counted from before the model was built:
    model, gradients, input batch, transients) is at most the cap and no
    OutOfMemoryError is raised (the process is also capped, at the cap + 5%,
    with torch.cuda.set_per_process_memory_fraction, so a step that would need
    more fails there rather than using the whole GPU). Measured peaks, not the
    allocator's fragmentation, decide, so the figure is reproducible. Reported
    with its ratio to native's (paper: up to 1.97x on ResNet-50, 1.34x on average).

Sanity check: every candidate's first step starts from the same weights, batch
and RNG state (the same dropout masks); its loss and every parameter's gradient
are compared with native's (gradient error: max |g - g_native| / max |g_native|
per parameter, see PROBE_TOLERANCE), and a difference beyond the tolerance of the
candidate's storage is printed as a WARNING (wrong values or gradients). Not
under --amp, where equivalent formulas already differ as much as wrong ones.

micro: the activations alone on one large tensor (2^24 elements on CUDA, 2^22 on
CPU, 2^20 with --quick), fp32 and bf16, forward + backward
(torch.autograd.grad(f(x), x, g)) for torch native, torch composed, checkpointed,
reprop (default storage and u8) and reprop compose (the composed module inside
enabled(compose=True)), and forward alone for torch native and reprop (x requires
grad, so reprop computes d). GB/s counts the bytes the candidate must move at
least: native forward reads x and writes y (2 elements), its backward reads g
and x and writes dx (3); reprop's forward reads x and writes y and d (3, d in
its storage dtype), its backward reads g and d and writes dx (3). A copy probe
of reprop's forward + backward traffic runs in the same alternation; "% copy" is
a candidate's GB/s over the probe's. "x native" is torch native's ms over the
candidate's, for the forward-only rows torch native fwd's. "grad err" is
max |dx - dx_native| / max |dx_native|; beyond its tolerance (MICRO_TOLERANCE for
the tensor's dtype, plus 8-bit storage's codebook bound) a WARNING.

A WARNING of either check makes the run exit with status 1, once the report is
printed and the JSON written.

Targets (printed PASS/FAIL, not asserted; timing targets are for CUDA, on CPU
for information):

  * composed chains save 2-4 tensors per activation, reprop compose saves 1;
  * with 8-bit storage the activations' bytes are <= 0.25x native's in fp32
    (0.5x under bf16 autocast);
  * reprop (default storage) steps within 2% of native; 8-bit no more than 2% slower;
  * reprop >= 1.15x faster than checkpointing the same activations: on the
    activation alone (micro) and, for information, on the whole step.

Candidates that cannot run (reprop missing, no enabled() yet, an error) are
reported as n/a with the reason.

--bytes-only counts the saved bytes and skips the rest of the steps part (with
--amp on a CPU without native bf16 a ResNet-50 step is ~40x slower than in fp32).

--quick: ResNet-50 with Mish (64x64 images) and a 2-layer BERT with tanh-GELU,
batch 2, 5 rounds (1 warm-up); micro on 2^20 elements for those two activations.

    python benchmarks/fad.py --quick                      # CI-sized, CPU (about a minute on 2 cores)
    python benchmarks/fad.py --device cuda --json $OUT/fad-cuda.json
    python benchmarks/fad.py --device cuda --amp --json $OUT/fad-cuda-amp.json
    python benchmarks/fad.py --models bert_base --acts gelu --parts steps
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import weakref
from dataclasses import dataclass, field
from typing import Callable, ContextManager

import torch
from torch import nn

# Run as a script, benchmarks/ is already on sys.path; as `python -m benchmarks.fad` it is not.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
import models  # noqa: E402

LR = 1e-4
PROBE_SEED = 1
# The first step's loss (relative difference) and gradients (gradient_error) may differ from
# native's by at most this, by the candidate's saved_dtype. None (f' in fp32): README, gradients
# equal torch's within rounding (the micro table's grad err: ~1e-7 per element), which a deep net
# grows: on --quick's ResNet-50 (batch 2, so layer4's train-mode BatchNorm normalizes over 8
# values) torch's own composed Mish is 5.3e-5 from native, reprop patch and compose 4.3e-5; BERT
# 7e-7. 1e-3 leaves 20x, and is 10x below the 8-bit storage's error. bf16 / uint8: README's table,
# f' within 0.4% (bf16's 8 bits) or half a 0.005 grid step (8-bit), measured 2.5e-2 and 1.9e-2 on
# that ResNet-50, 2.3e-3 and 2.8e-3 on BERT. A sign-flipped derivative is 2 off, Swish's derivative
# in Mish's place 0.93. Not compared under --amp: the bf16 forward puts torch's own composed Mish
# 0.97 from native on that ResNet-50, as far as a wrong derivative.
PROBE_TOLERANCE = {None: 1e-3, torch.bfloat16: 0.1, torch.uint8: 0.1}
# The micro part's grad err (max |dx - dx_native| / max |dx_native|) may be at most this, by the
# tensor's dtype: every candidate computes the same derivative, rounded otherwise. Measured over
# swish, mish, gelu and gelu_tanh at 2^20 and 2^22 elements (x ~ N(0, 9), g ~ N(0, 1)): at most
# 7.4e-7 in fp32 (tanh-GELU, torch's own composed formula as much as reprop), 1.1e-2 in bf16, where
# each op rounds to 8 bits (2^-8 = 3.9e-3; torch's composed Swish 1.1e-2, reprop 6.4e-3). 8-bit
# storage adds its codebook's error: f' off by at most max_error (half a grid step, 0.0024-0.0025
# here), so dx by max_error |g| (MicroCandidate.storage_error; measured 2.1e-3 to 2.3e-3 in all).
# A wrong derivative is off by O(1): a negated one by 2, Swish's in Mish's place by 0.93.
MICRO_TOLERANCE = {"fp32": 1e-5, "bf16": 3e-2}
# A gradient below GRAD_FLOOR x the model's largest is measured in units of that floor: one that
# cancels to rounding noise has no relative accuracy (BERT's attention key bias: softmax ignores a
# shift shared by all keys, so its exact gradient is 0; native's is 1e-10 of the largest).
GRAD_FLOOR = 1e-3
MIB = 2**20
PARTS = ("steps", "micro")
MODEL_NAMES = ("resnet50", "bert_base")
DEFAULT_ACTS = {"resnet50": ("swish", "mish", "gelu_tanh"), "bert_base": ("gelu", "gelu_tanh")}
QUICK_ACTS = {"resnet50": ("mish",), "bert_base": ("gelu_tanh",)}
FULL = {"batch": 32, "image_size": 224, "bert_layers": 12, "reps": 20, "warmup": 3, "micro_reps": 30}
QUICK = {"batch": 2, "image_size": 64, "bert_layers": 2, "reps": 5, "warmup": 1, "micro_reps": 15}
MICRO_LOG2 = {"cuda": 24, "cpu": 22, "quick": 20}
MICRO_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MAX_BATCH_LIMIT = 4096  # the search stops doubling here

# Targets (printed as PASS/FAIL, never asserted).
TARGET_U8_BYTES = {False: 0.25, True: 0.5}  # u8 act bytes / native act bytes; key: --amp
TARGET_STEP_SLOWDOWN = 1.02                 # candidate ms / native ms, at most
TARGET_OVER_CKPT = 1.15                     # checkpointed ms / reprop ms, at least
COMPOSED_TENSORS = (2, 4)                   # tensors per call autograd saves for a composed chain


# ---------------------------------------------------------------------------
# Candidates
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """One way to run the activations of a model."""

    name: str
    variant: str               # models.VARIANTS: the activation modules the model is built with
    reprop: str | None = None  # None, "patch" (reprop.fad.patch) or "compose" (reprop.fad.enabled)
    saved_dtype: torch.dtype | None = None


NATIVE, COMPOSED, CHECKPOINTED = "native", "composed", "checkpointed"
PATCH, PATCH_BF16, PATCH_U8 = "reprop patch", "reprop patch bf16", "reprop patch u8"
COMPOSE, COMPOSE_BF16 = "reprop compose", "reprop compose bf16"
CANDIDATES = {c.name: c for c in (
    Candidate(NATIVE, "native"),
    Candidate(COMPOSED, "composed"),
    Candidate(CHECKPOINTED, "checkpointed"),
    Candidate(PATCH, "native", "patch"),
    Candidate(PATCH_BF16, "native", "patch", torch.bfloat16),
    Candidate(PATCH_U8, "native", "patch", torch.uint8),
    Candidate(COMPOSE, "composed", "compose"),
    Candidate(COMPOSE_BF16, "composed", "compose", torch.bfloat16),
)}


@dataclass(frozen=True)
class Case:
    """One model with one activation function."""

    model: str  # MODEL_NAMES
    act: str    # key of models.ACTIVATIONS

    @property
    def label(self) -> str:
        return f"{self.model} {self.act}"


def reprop_fad():
    """reprop.fad, imported on first use (ImportError when reprop is not installed)."""
    import reprop.fad
    return reprop.fad


def build_model(case: Case, act: Callable[[], nn.Module], args) -> nn.Module:
    """The case's model with ``act`` as its activation factory, seeded: every candidate starts alike."""
    torch.manual_seed(0)
    if case.model == "resnet50":
        return models.resnet50(act=act)
    return models.bert_base(act=act, layers=args.bert_layers)


def make_batch(case: Case, batch: int, device: torch.device, args) -> tuple[torch.Tensor, torch.Tensor]:
    return models.make_batch(case.model, batch, device, args.image_size, args.seq_len)


def forward_context(candidate: Candidate, device: torch.device, amp: bool) -> Callable[[], ContextManager]:
    """What the forward pass (model and loss) of ``candidate`` runs inside: autocast, reprop's mode.

    Backward runs outside, as torch recommends for autocast.
    """
    def enter() -> ContextManager:
        stack = contextlib.ExitStack()
        if amp:
            stack.enter_context(torch.autocast(device.type, dtype=torch.bfloat16))
        if candidate.reprop == "compose":
            stack.enter_context(reprop_fad().enabled(compose=True, saved_dtype=candidate.saved_dtype))
        return stack
    return enter


@dataclass(frozen=True)
class Probe:
    """Loss, gradient norm and gradient_error against native's of a candidate's first step (Trainer.probe)."""

    loss: float
    grad_norm: float
    grad_error: float | None = None  # None: native itself, the reference

    def error(self, reference: "Probe") -> float:
        """The larger of the loss's relative difference from ``reference``'s and grad_error."""
        return max(abs(self.loss - reference.loss) / abs(reference.loss), self.grad_error or 0.0)


def gradient_error(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """max over parameters of max |g - g_ref| / max(max |g_ref|, GRAD_FLOOR x the largest |g_ref|).

    inf when the candidate lacks a gradient native has or the reverse.
    """
    if set(grads) != set(reference):
        return float("inf")
    floor = GRAD_FLOOR * max(float(g.float().abs().max()) for g in reference.values())
    return max(harness.relative_error(grads[n], g, max(float(g.float().abs().max()), floor))
               for n, g in reference.items())


@dataclass
class Trainer:
    """One candidate's model, optimizer and forward context."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    context: Callable[[], ContextManager]
    patched: dict[str, str]

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self.context():
            return models.cross_entropy(self.model(x), y)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """One training step: forward, backward, SGD update, gradients freed."""
        self.loss(x, y).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def probe(self, x: torch.Tensor, y: torch.Tensor,
              reference: dict[str, torch.Tensor] | None) -> tuple[Probe, dict[str, torch.Tensor]]:
        """A first step from a fixed RNG state (the same dropout masks in every candidate): its loss,
        gradient norm and gradient_error against ``reference`` (native's gradients), and its gradients.

        On CUDA without TF32 and with deterministic cuDNN algorithms: TF32 rounds
        a convolution's inputs to 10 bits, and nondeterministic algorithms sum in
        any order, either of which the net grows far beyond PROBE_TOLERANCE.
        """
        torch.manual_seed(PROBE_SEED)
        with harness.reproducible():
            loss = self.loss(x, y)
            loss.backward()
        grads = {n: p.grad for n, p in self.model.named_parameters() if p.grad is not None}
        norm = torch.stack([g.float().norm() for g in grads.values()]).norm()
        probe = Probe(float(loss.detach()), float(norm),
                      gradient_error(grads, reference) if reference is not None else None)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)  # drops .grad, not the tensors returned
        return probe, grads


def make_trainer(candidate: Candidate, case: Case, device: torch.device, args,
                 act: Callable[[], nn.Module] | None = None) -> Trainer:
    """A fresh model for ``candidate`` on ``device`` (``act`` overrides its activation factory)."""
    model = build_model(case, act or models.activation(case.act, candidate.variant), args)
    model = model.to(device).train()
    patched = {}
    if candidate.reprop == "patch":
        patched = reprop_fad().patch(model, saved_dtype=candidate.saved_dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    return Trainer(model, optimizer, forward_context(candidate, device, args.amp), patched)


def describe_error(e: BaseException) -> str:
    """``Type: first line of the message`` (shortened), for n/a reasons."""
    text = str(e).splitlines()[0][:140] if str(e) else ""
    return f"{type(e).__name__}: {text}"


def try_trainer(candidate: Candidate, case: Case, batch, device: torch.device, args,
                reference: dict[str, torch.Tensor] | None) -> tuple[Trainer, Probe, dict[str, torch.Tensor]] | str:
    """make_trainer plus its probe step (Trainer.probe); the reason as a string when the candidate is n/a."""
    try:
        trainer = make_trainer(candidate, case, device, args)
        return trainer, *trainer.probe(*batch, reference)
    except Exception as e:  # noqa: BLE001 - any failure means "n/a here", with the reason shown
        return describe_error(e)


# ---------------------------------------------------------------------------
# Bytes saved for backward
# ---------------------------------------------------------------------------


@dataclass
class Saved:
    """Storages saved for backward by one forward: bytes and count."""

    nbytes: int = 0
    tensors: int = 0


class Packed:
    """What the pack hook hands autograd instead of the tensor: alive exactly as long as the saved slot."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class SavedCounter:
    """saved_tensors_hooks that find the storages autograd still holds at the end of a forward.

    The pack hook wraps each saved tensor in a Packed (unpack returns the
    tensor, so backward would be unchanged) and keeps a weak reference to it:
    a saved slot freed during the forward (e.g. the node of an intermediate
    that died) drops its Packed, so only what the graph still holds is
    counted. Storages in ``exclude`` (data pointers of the parameters and the
    input batch) and tensors of at most one element are skipped.
    """

    def __init__(self, exclude: set[int]):
        self.exclude = exclude
        self.packed: list[tuple[weakref.ref, int, int]] = []  # (Packed, storage pointer, storage bytes)

    def pack(self, t: torch.Tensor) -> Packed:
        holder = Packed(t)
        if t.numel() > 1:
            storage = t.untyped_storage()
            if storage.data_ptr() not in self.exclude:
                self.packed.append((weakref.ref(holder), storage.data_ptr(), storage.nbytes()))
        return holder

    @staticmethod
    def unpack(holder: Packed) -> torch.Tensor:
        return holder.tensor

    def retained(self) -> Saved:
        """Bytes and number of the distinct storages whose saved slots are still alive."""
        gc.collect()  # slots held only by reference cycles are garbage, not retained
        storages: dict[int, int] = {}
        for ref, ptr, nbytes in self.packed:
            if ref() is not None:
                storages[ptr] = max(storages.get(ptr, 0), nbytes)
        return Saved(sum(storages.values()), len(storages))


def count_saved(trainer: Trainer, batch) -> Saved:
    """What autograd holds for backward after one forward (model and loss) of ``trainer``."""
    exclude = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
    exclude |= {t.untyped_storage().data_ptr() for t in batch}
    counter = SavedCounter(exclude)
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        loss = trainer.loss(*batch)
    saved = counter.retained()
    del loss
    return saved


@dataclass
class ActivationCalls:
    """The activation calls of one forward: how many, and their inputs' bytes in total."""

    calls: int
    input_bytes: int


def activation_calls(case: Case, batch, device: torch.device, args) -> ActivationCalls:
    """Count the native activation modules' calls in one forward, with forward pre-hooks.

    Runs under the same precision as the candidates (input dtype under autocast).
    """
    trainer = make_trainer(CANDIDATES[NATIVE], case, device, args)
    act_type = type(models.activation(case.act, "native")())
    seen = ActivationCalls(0, 0)

    def hook(module, inputs):
        seen.calls += 1
        seen.input_bytes += inputs[0].numel() * inputs[0].element_size()

    handles = [m.register_forward_pre_hook(hook) for m in trainer.model.modules() if type(m) is act_type]
    with torch.no_grad():
        trainer.loss(*batch)
    for h in handles:
        h.remove()
    return seen


# ---------------------------------------------------------------------------
# Largest batch under a memory cap (CUDA)
# ---------------------------------------------------------------------------


def second_step_peak(trainer: Trainer, batch, device: torch.device) -> int:
    """torch.cuda.max_memory_allocated during the second of two steps on ``batch``.

    The first step is a warm-up (lazy workspaces, cuDNN's algorithm choice).
    """
    trainer.step(*batch)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    trainer.step(*batch)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device)


def batch_peak(trainer: Trainer, case: Case, batch_size: int, device: torch.device, args) -> int | None:
    """second_step_peak at ``batch_size``; None when it raised OutOfMemoryError."""
    try:
        peak = second_step_peak(trainer, make_batch(case, batch_size, device, args), device)
    except torch.cuda.OutOfMemoryError:
        trainer.optimizer.zero_grad(set_to_none=True)
        peak = None
    harness.release(device)  # after the handler: the failed step's tensors are gone
    return peak


def largest_batch(candidate: Candidate, case: Case, cap: int, device: torch.device, args) -> int:
    """The largest batch size whose step peaks at most ``cap`` bytes, the model included (0: not even 1).

    One model for the whole search, its bytes counted from before it was built;
    doubling from 1, then bisection.
    """
    harness.release(device)
    base = torch.cuda.memory_allocated(device)
    trainer = make_trainer(candidate, case, device, args)

    def fits(b: int) -> bool:
        peak = batch_peak(trainer, case, b, device, args)
        return peak is not None and peak - base <= cap

    if not fits(1):
        return 0
    lo = 1
    while lo * 2 <= MAX_BATCH_LIMIT and fits(lo * 2):
        lo *= 2
    hi = lo * 2  # does not fit (or beyond the limit)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


@contextlib.contextmanager
def memory_cap(cap: int, device: torch.device):
    """Limit this process's CUDA allocations to ``cap`` bytes (plus 5% slack), then lift the limit."""
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap * 1.05 / total), device)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)


# ---------------------------------------------------------------------------
# One case of the steps part
# ---------------------------------------------------------------------------


@dataclass
class CaseResult:
    """Everything measured for one (model, activation)."""

    case: Case
    batch: int
    calls: ActivationCalls
    identity: Saved  # the same model with nn.Identity activations
    saved: dict[str, Saved] = field(default_factory=dict)
    stats: dict[str, harness.Stats] = field(default_factory=dict)
    peak_bytes: dict[str, int | None] = field(default_factory=dict)
    max_batch: dict[str, int] = field(default_factory=dict)
    patched: dict[str, int] = field(default_factory=dict)  # candidate -> modules patch changed
    probes: dict[str, Probe] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)

    def probe_errors(self) -> dict[str, float]:
        """Each other candidate's Probe.error against native's (empty when native is n/a)."""
        ref = self.probes.get(NATIVE)
        return {n: p.error(ref) for n, p in self.probes.items() if ref is not None and n != NATIVE}

    def median(self, name: str) -> float | None:
        s = self.stats.get(name)
        return s.median if s else None

    def act_bytes(self, name: str) -> int | None:
        """Bytes the activations add to what the forward saves (see the module docstring)."""
        s = self.saved.get(name)
        return s.nbytes - self.identity.nbytes if s else None

    def act_x(self, name: str) -> float | None:
        """act_bytes in units of the activations' inputs."""
        b = self.act_bytes(name)
        return b / self.calls.input_bytes if b is not None and self.calls.input_bytes else None

    def act_tensors(self, name: str) -> float | None:
        """Extra saved storages per activation call."""
        s = self.saved.get(name)
        return (s.tensors - self.identity.tensors) / self.calls.calls if s and self.calls.calls else None


def run_case(case: Case, names: list[str], device: torch.device, args) -> CaseResult:
    """Bytes saved, step times (alternated), peaks and (CUDA) largest batches of every candidate."""
    batch = make_batch(case, args.batch, device, args)
    identity = make_trainer(CANDIDATES[NATIVE], case, device, args, act=nn.Identity)
    result = CaseResult(case, args.batch, activation_calls(case, batch, device, args),
                        count_saved(identity, batch))
    del identity
    trainers = start_candidates(result, names, batch, device, args)
    if args.bytes_only:
        return result
    result.stats = harness.measure_alternated(
        {name: (lambda t=t: t.step(*batch)) for name, t in trainers.items()}, device, args.warmup, args.reps)
    available = list(trainers)
    trainers.clear()
    harness.release(device)
    result.peak_bytes = {name: steady_peak(CANDIDATES[name], case, batch, device, args) for name in available}
    if device.type == "cuda" and args.mem_cap_gib > 0:
        result.max_batch = largest_batches(case, available, device, args)
    return result


def start_candidates(result: CaseResult, names: list[str], batch, device: torch.device,
                     args) -> dict[str, Trainer]:
    """Each candidate's trainer after its probe step, with its saved bytes recorded; n/a ones noted.

    Native first: its probe's gradients are the others' reference (held only here).
    """
    trainers: dict[str, Trainer] = {}
    reference = None
    for name in sorted(names, key=lambda n: n != NATIVE):
        got = try_trainer(CANDIDATES[name], result.case, batch, device, args, reference)
        if isinstance(got, str):
            result.unavailable[name] = got
            continue
        trainer, result.probes[name], grads = got
        if name == NATIVE:
            reference = grads
        result.saved[name] = count_saved(trainer, batch)
        if trainer.patched:
            result.patched[name] = len(trainer.patched)
        trainers[name] = trainer
    return trainers


def largest_batches(case: Case, names: list[str], device: torch.device, args) -> dict[str, int]:
    """largest_batch of each candidate under --mem-cap-gib, one candidate alive at a time."""
    cap = int(args.mem_cap_gib * 2**30)
    found = {}
    with memory_cap(cap, device):
        for name in names:
            print(f"... {case.label} {name}: largest batch under {args.mem_cap_gib} GiB",
                  file=sys.stderr, flush=True)
            found[name] = largest_batch(CANDIDATES[name], case, cap, device, args)
    return found


def steady_peak(candidate: Candidate, case: Case, batch, device: torch.device, args) -> int | None:
    """harness.peak_memory of one step after one warm-up step, the model built inside (counted)."""
    holder: list[Trainer] = []

    def setup() -> None:
        holder.append(make_trainer(candidate, case, device, args))
        holder[0].step(*batch)

    peak = harness.peak_memory(lambda: holder[0].step(*batch), device, setup)
    holder.clear()
    harness.release(device)
    return peak


# ---------------------------------------------------------------------------
# Micro-benchmark: the activations alone
# ---------------------------------------------------------------------------

# reprop.fad's functional for each activation, with its keyword arguments.
REPROP_FUNCTIONAL = {"swish": ("silu", {}), "mish": ("mish", {}), "gelu": ("gelu", {}),
                     "gelu_tanh": ("gelu", {"approximate": "tanh"})}
# reprop.fad.codebook's name for each activation (it names GELU's tanh form apart).
CODEBOOK = {"swish": "silu", "mish": "mish", "gelu": "gelu", "gelu_tanh": "gelu_tanh"}


@dataclass(frozen=True)
class MicroCandidate:
    """One way to run an activation on one tensor, and the bytes it must move at least."""

    name: str
    backward: bool
    build: Callable[[str], Callable[[torch.Tensor], torch.Tensor]]  # act name -> y = f(x)
    elements_moved: Callable[[int], float] | None = None  # element size of x -> bytes per element
    # act name -> the largest error of f' as the candidate stores it (8-bit codes); None: in x's dtype
    storage_error: Callable[[str], float] | None = None


def reprop_function(act: str, saved_dtype=None) -> Callable[[torch.Tensor], torch.Tensor]:
    """reprop.fad's functional form of ``act``."""
    name, kwargs = REPROP_FUNCTIONAL[act]
    fn = getattr(reprop_fad(), name)
    return lambda x: fn(x, saved_dtype=saved_dtype, **kwargs)


def codebook_error(act: str) -> float:
    """The largest error of f' in reprop.fad's 8-bit storage of ``act``: its codebook's max_error."""
    return reprop_fad().codebook(CODEBOOK[act]).max_error


def composed_under_compose(act: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The composed module, run inside reprop.fad.enabled(compose=True)."""
    module, fad = models.activation(act, "composed")(), reprop_fad()

    def run(x: torch.Tensor) -> torch.Tensor:
        with fad.enabled(compose=True):
            return module(x)
    return run


MICRO_CANDIDATES = (
    MicroCandidate("torch native", True, lambda a: models.activation(a, "native")(), lambda es: 5 * es),
    MicroCandidate("torch composed", True, lambda a: models.activation(a, "composed")()),
    MicroCandidate("checkpointed", True, lambda a: models.activation(a, "checkpointed")()),
    MicroCandidate("reprop", True, reprop_function, lambda es: 6 * es),
    MicroCandidate("reprop u8", True, lambda a: reprop_function(a, torch.uint8), lambda es: 4 * es + 2,
                   codebook_error),
    MicroCandidate("reprop compose", True, composed_under_compose, lambda es: 6 * es),
    MicroCandidate("torch native fwd", False, lambda a: models.activation(a, "native")(), lambda es: 2 * es),
    MicroCandidate("reprop fwd", False, reprop_function, lambda es: 3 * es),
)
# The "x native" reference of a micro row, by MicroCandidate.backward: forward + backward rows (and
# the probe of reprop's forward + backward traffic) against native's forward + backward, forward-only
# rows against native's forward alone.
MICRO_REFERENCE = {True: "torch native", False: "torch native fwd"}
PROBE = "copy"


@dataclass
class MicroResult:
    """One activation at one dtype: timings, bytes moved and gradient errors per candidate."""

    act: str
    dtype: str
    numel: int
    stats: dict[str, harness.Stats] = field(default_factory=dict)
    nbytes: dict[str, float] = field(default_factory=dict)
    grad_err: dict[str, float] = field(default_factory=dict)
    grad_tolerance: dict[str, float] = field(default_factory=dict)  # micro_tolerance
    unavailable: dict[str, str] = field(default_factory=dict)

    def gbps(self, name: str) -> float | None:
        s = self.stats.get(name)
        return harness.gbps(self.nbytes[name], s.median) if s and name in self.nbytes else None


def micro_call(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, g: torch.Tensor,
               backward: bool) -> Callable[[], object]:
    """f(x) (x requires grad, so the graph is built) and, with ``backward``, dx = vjp(g)."""
    if backward:
        return lambda: torch.autograd.grad(fn(x), x, g)
    return lambda: fn(x)


def micro_tolerance(c: MicroCandidate, act: str, dtype_name: str, g: torch.Tensor, reference: torch.Tensor) -> float:
    """The grad err ``c`` may have: MICRO_TOLERANCE, plus its storage's error (f' off by e puts
    dx off by e |g|) in units of max |dx_native|."""
    tolerance = MICRO_TOLERANCE[dtype_name]
    if c.storage_error is not None:
        tolerance += c.storage_error(act) * float(g.abs().max()) / float(reference.abs().max())
    return tolerance


def run_micro(act: str, dtype_name: str, numel: int, device: torch.device, args) -> MicroResult:
    """Time every micro candidate on one (numel,) tensor with a copy probe of reprop's traffic."""
    dtype = MICRO_DTYPES[dtype_name]
    result = MicroResult(act, dtype_name, numel)
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(numel, generator=gen)).to(device, dtype).requires_grad_()
    g = torch.randn(numel, generator=gen).to(device, dtype)
    es = x.element_size()
    (reference,) = torch.autograd.grad(models.activation(act, "native")()(x), x, g)
    calls: dict[str, Callable[[], object]] = {}
    for c in MICRO_CANDIDATES:
        try:
            call = micro_call(c.build(act), x, g, c.backward)
            out = call()
        except Exception as e:  # noqa: BLE001 - n/a with the reason
            result.unavailable[c.name] = describe_error(e)
            continue
        calls[c.name] = call
        if c.elements_moved is not None:
            result.nbytes[c.name] = numel * c.elements_moved(es)
        if c.backward:
            result.grad_err[c.name] = harness.relative_error(out[0], reference)
            result.grad_tolerance[c.name] = micro_tolerance(c, act, dtype_name, g, reference)
    result.nbytes[PROBE] = 6 * numel * es
    calls[PROBE] = harness.make_bandwidth_probe(int(result.nbytes[PROBE]), device, PROBE)
    result.stats = harness.measure_alternated(calls, device, args.warmup, args.micro_reps)
    return result


# ---------------------------------------------------------------------------
# Targets
# ---------------------------------------------------------------------------


def check(target: str, where: str, value: float | None, ok: Callable[[float], bool], text: str) -> dict | None:
    """One target line, or None when the value is missing (a candidate n/a)."""
    if value is None:
        return None
    return {"target": target, "case": where, "value": text.format(value), "pass": bool(ok(value))}


def step_targets(r: CaseResult, amp: bool) -> list[dict]:
    """The issue's targets read from one case of the steps part."""
    native_ms, ckpt_ms = r.median(NATIVE), r.median(CHECKPOINTED)
    native_act = r.act_bytes(NATIVE)

    def slower(name):
        ms = r.median(name)
        return ms / native_ms if ms and native_ms else None

    def over_ckpt(name):
        ms = r.median(name)
        return ckpt_ms / ms if ms and ckpt_ms else None

    u8 = r.act_bytes(PATCH_U8)
    u8_ratio = u8 / native_act if u8 is not None and native_act else None
    limit = TARGET_U8_BYTES[amp]
    lo, hi = COMPOSED_TENSORS
    checks = [
        check("composed chain saves 2-4 tensors per activation", r.case.label, r.act_tensors(COMPOSED),
              lambda v: lo - 0.05 <= v <= hi + 0.05, "{:.2f} per call"),
        check("reprop compose saves 1 tensor per activation", r.case.label, r.act_tensors(COMPOSE),
              lambda v: abs(v - 1) < 0.05, "{:.2f} per call"),
        check("reprop compose bf16 saves 1 tensor per activation", r.case.label,
              r.act_tensors(COMPOSE_BF16), lambda v: abs(v - 1) < 0.05, "{:.2f} per call"),
        check(f"u8 activation bytes <= {limit}x native", r.case.label, u8_ratio,
              lambda v: v <= limit, "{:.3f}x"),
        check("reprop patch step within 2% of native", r.case.label, slower(PATCH),
              lambda v: v <= TARGET_STEP_SLOWDOWN, "{:.3f}x native ms"),
        check("reprop compose step within 2% of native", r.case.label, slower(COMPOSE),
              lambda v: v <= TARGET_STEP_SLOWDOWN, "{:.3f}x native ms"),
        check("reprop patch u8 step no more than 2% slower than native", r.case.label, slower(PATCH_U8),
              lambda v: v <= TARGET_STEP_SLOWDOWN, "{:.3f}x native ms"),
        check("reprop patch >= 1.15x checkpointed (whole step, information)", r.case.label,
              over_ckpt(PATCH), lambda v: v >= TARGET_OVER_CKPT, "{:.3f}x"),
        check("reprop compose >= 1.15x checkpointed (whole step, information)", r.case.label,
              over_ckpt(COMPOSE), lambda v: v >= TARGET_OVER_CKPT, "{:.3f}x"),
    ]
    return [c for c in checks if c is not None]


def micro_targets(r: MicroResult) -> list[dict]:
    """reprop (default storage) against checkpointing, the activation alone."""
    ckpt = r.stats.get("checkpointed")
    where = f"{r.act} {r.dtype} 2^{r.numel.bit_length() - 1}"
    checks = []
    for name in ("reprop", "reprop compose"):
        s = r.stats.get(name)
        value = harness.speedup(ckpt.median, s.median) if s and ckpt else None
        checks.append(check(f"{name} >= 1.15x checkpointed (activation alone)", where, value,
                            lambda v: v >= TARGET_OVER_CKPT, "{:.2f}x"))
    return [c for c in checks if c is not None]


# ---------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------


def ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def mib(nbytes: int | None) -> float | None:
    return None if nbytes is None else nbytes / MIB


def step_rows(r: CaseResult, names: list[str]) -> list[dict]:
    """One row per candidate of a case (None where n/a)."""
    rows = []
    for name in names:
        s = r.stats.get(name)
        saved = r.saved.get(name)
        native_saved = r.saved.get(NATIVE)
        peak = r.peak_bytes.get(name)
        rows.append({
            "case": r.case.label, "candidate": name,
            "ms": s.median if s else None, "iqr": s.iqr / s.median if s else None,
            "x_native": ratio(r.median(NATIVE), s.median) if s else None,
            "x_ckpt": ratio(r.median(CHECKPOINTED), s.median) if s else None,
            "act_mib": mib(r.act_bytes(name)), "act_x": r.act_x(name), "act_tensors": r.act_tensors(name),
            "saved_mib": mib(saved.nbytes) if saved else None,
            "saved_vs_native": ratio(saved.nbytes, native_saved.nbytes) if saved and native_saved else None,
            "peak_mib": mib(peak),
            "peak_vs_native": ratio(peak, r.peak_bytes.get(NATIVE)) if peak else None,
            "max_batch": r.max_batch.get(name),
            "batch_vs_native": ratio(r.max_batch.get(name), r.max_batch.get(NATIVE)),
        })
    return rows


def format_steps(rows: list[dict], cuda: bool) -> str:
    f = harness.fmt
    headers = ["case", "candidate", "ms", "IQR", "x native", "x ckpt", "act MiB", "act x", "tensors",
               "saved MiB", "saved/nat", "peak MiB", "peak/nat"]
    if cuda:
        headers += ["max batch", "batch/nat"]
    table = []
    for row in rows:
        cells = [row["case"], row["candidate"], f(row["ms"], ".2f"), f(row["iqr"], ".0%"),
                 f(row["x_native"], ".3f"), f(row["x_ckpt"], ".3f"), f(row["act_mib"], ".1f"),
                 f(row["act_x"], ".2f"), f(row["act_tensors"], ".2f"), f(row["saved_mib"], ".1f"),
                 f(row["saved_vs_native"], ".3f"), f(row["peak_mib"], ".1f"), f(row["peak_vs_native"], ".3f")]
        if cuda:
            cells += [f(row["max_batch"]), f(row["batch_vs_native"], ".2f")]
        table.append(cells)
    return harness.format_table(headers, table)


def micro_rows(r: MicroResult) -> list[dict]:
    """One row per micro candidate (and the probe) of one activation and dtype."""
    probe = r.gbps(PROBE)
    backward = {c.name: c.backward for c in MICRO_CANDIDATES} | {PROBE: True}
    rows = []
    for name in backward:
        s = r.stats.get(name)
        reference = r.stats.get(MICRO_REFERENCE[backward[name]])
        rows.append({
            "act": r.act, "dtype": r.dtype, "numel": r.numel, "candidate": name,
            "ms": s.median if s else None, "iqr": s.iqr / s.median if s else None,
            "x_native": ratio(reference.median, s.median) if s and reference else None,
            "gbps": r.gbps(name), "pct_copy": ratio(r.gbps(name), probe),
            "grad_err": r.grad_err.get(name),
        })
    return rows


def format_micro(rows: list[dict]) -> str:
    f = harness.fmt
    return harness.format_table(
        ["activation", "candidate", "ms", "IQR", "x native", "GB/s", "% copy", "grad err"],
        [[f"{row['act']} {row['dtype']}", row["candidate"], f(row["ms"], ".3f"), f(row["iqr"], ".0%"),
          f(row["x_native"], ".2f"), f(row["gbps"], ".1f"), f(row["pct_copy"], ".0%"),
          f(row["grad_err"], ".1e")] for row in rows])


def unavailable_by_reason(results: list[CaseResult], micro: list[MicroResult]) -> dict[str, list[str]]:
    """{reason: ["case candidate", ...]}: one line per distinct reason (e.g. reprop not installed)."""
    grouped: dict[str, list[str]] = {}
    for r in [*results, *micro]:
        where = r.case.label if isinstance(r, CaseResult) else f"micro {r.act} {r.dtype}"
        for name, why in r.unavailable.items():
            grouped.setdefault(why, []).append(f"{where} {name}")
    return grouped


def print_report(results: list[CaseResult], micro: list[MicroResult], checks: list[dict], names: list[str],
                 info: dict, args) -> None:
    """Machine, settings, the steps and micro tables, n/a reasons, targets."""
    print(harness.describe_machine(info))
    cuda = args.device == "cuda"
    precision = "bf16 autocast" if args.amp else "fp32"
    if results:
        print(f"\nsteps: {precision}, batch {args.batch}, ResNet images {args.image_size}x{args.image_size}, "
              f"BERT {args.bert_layers} layers x sequence {args.seq_len}; {args.reps} rounds "
              f"({args.warmup} warm-ups), medians in ms; step = forward + backward + SGD + zero_grad")
        print("x native / x ckpt = native / checkpointed ms over the candidate's (> 1: faster); act = bytes "
              "the activations add to the saved tensors (vs nn.Identity), x = in units of their inputs, "
              "tensors = saved storages per activation call; peak = one steady-state step "
              f"({'CUDA counters' if cuda else 'CPU: profiler allocation events'})"
              + (f"; max batch under {args.mem_cap_gib} GiB" if cuda and args.mem_cap_gib > 0 else "") + "\n")
        print(format_steps([row for r in results for row in step_rows(r, names)],
                           cuda and args.mem_cap_gib > 0))
        for r in results:
            print(f"{r.case.label}: {r.calls.calls} activation calls, inputs {mib(r.calls.input_bytes):.1f} MiB; "
                  f"Identity model saves {mib(r.identity.nbytes):.1f} MiB"
                  + (f"; patch() swapped {max(r.patched.values())} modules" if r.patched else ""))
    if micro:
        print(f"\nmicro: one tensor of 2^{args.micro_log2} elements per activation, forward + backward unless "
              f"'fwd'; {args.micro_reps} rounds; x native = torch native ms (of 'fwd' rows: torch native fwd) / "
              "the candidate's; GB/s over the bytes the candidate must move; % copy = over a copy of reprop's "
              "fwd+bwd traffic\n")
        print(format_micro([row for r in micro for row in micro_rows(r)]))
        harness.print_check(f"micro: dx against torch native's (grad err) within {MICRO_TOLERANCE['fp32']:g} "
                            f"in fp32, {MICRO_TOLERANCE['bf16']:g} in bf16, with 8-bit storage also its codebook's "
                            "max error x max |g| / max |dx_native|", micro_problems(micro))
    for why, where in unavailable_by_reason(results, micro).items():
        print(f"n/a: {why}: {', '.join(where)}")
    print_probe_check(results, args.amp)
    if checks:
        print(f"\ntargets{'' if cuda else ' (timing targets are for CUDA; on CPU for information)'}:")
        for c in checks:
            print(f"  {'PASS' if c['pass'] else 'FAIL'}  {c['case']}: {c['target']} ({c['value']})")


def micro_problems(micro: list[MicroResult]) -> list[str]:
    """A line per micro candidate whose grad err is beyond its tolerance (micro_tolerance)."""
    return [f"micro {r.act} {r.dtype} {name}: grad err {error:.2g} vs torch native's, beyond "
            f"{r.grad_tolerance[name]:.2g} (wrong derivative?)"
            for r in micro for name, error in r.grad_err.items() if not harness.within(error, r.grad_tolerance[name])]


def probe_problems(results: list[CaseResult], amp: bool) -> list[str]:
    """A line per candidate whose first step is beyond its PROBE_TOLERANCE from native's (none under
    --amp, where they are not compared)."""
    problems = []
    for r in results:
        for name, error in ({} if amp else r.probe_errors()).items():
            tolerance = PROBE_TOLERANCE[CANDIDATES[name].saved_dtype]
            if not harness.within(error, tolerance):  # NaN too
                p, ref = r.probes[name], r.probes[NATIVE]
                problems.append(f"{r.case.label} {name}: first step loss {p.loss:.6g} (native {ref.loss:.6g}), "
                                f"gradient error {p.grad_error:.3g}, tolerance {tolerance:g}: wrong values or "
                                "gradients?")
    return problems


def check_failed(results: list[CaseResult], micro: list[MicroResult], amp: bool) -> bool:
    """Whether a first step (probe_problems) or a micro gradient (micro_problems) is wrong."""
    return bool(probe_problems(results, amp) or micro_problems(micro))


def print_probe_check(results: list[CaseResult], amp: bool) -> None:
    """A WARNING per candidate whose first step is beyond its PROBE_TOLERANCE from native's, then a summary."""
    errors = [(name, error) for r in results for name, error in r.probe_errors().items()]
    if not errors:
        return
    if amp:
        largest = max(e for _, e in errors)
        print(f"first step against native's: not compared under --amp (largest error {largest:.2g}; see "
              "PROBE_TOLERANCE)")
        return
    worst: dict[float, float] = {}  # tolerance -> the largest error of the candidates it applies to
    for name, error in errors:
        tolerance = PROBE_TOLERANCE[CANDIDATES[name].saved_dtype]
        worst[tolerance] = max(worst.get(tolerance, 0.0), error)
    low = PROBE_TOLERANCE[torch.uint8]
    harness.print_check(f"first step against native's (same weights, batch, dropout masks): loss and gradients "
                        f"(max |g - g_native| / max |g_native| per parameter) within {PROBE_TOLERANCE[None]:g} for "
                        f"f' stored in fp32 (largest {worst.get(PROBE_TOLERANCE[None], 0.0):.2g}), {low:g} for bf16 "
                        f"and u8 (largest {worst.get(low, 0.0):.2g})", probe_problems(results, amp))


def json_payload(results: list[CaseResult], micro: list[MicroResult], checks: list[dict], names: list[str],
                 info: dict, args) -> dict:
    return {
        "benchmark": "fad",
        "machine": info,
        "config": {k: v for k, v in vars(args).items() if k != "json"} | {
            "lr": LR, "probe_tolerance": {str(k): v for k, v in PROBE_TOLERANCE.items()}, "grad_floor": GRAD_FLOOR,
            "micro_tolerance": MICRO_TOLERANCE},
        "cases": [{
            "model": r.case.model, "act": r.case.act, "batch": r.batch,
            "activation_calls": r.calls.calls, "activation_input_bytes": r.calls.input_bytes,
            "identity_saved_bytes": r.identity.nbytes, "identity_saved_tensors": r.identity.tensors,
            "saved": {n: {"bytes": s.nbytes, "tensors": s.tensors} for n, s in r.saved.items()},
            "stats_ms": {n: s.to_dict() for n, s in r.stats.items()},
            "peak_bytes": r.peak_bytes, "max_batch": r.max_batch, "patched_modules": r.patched,
            "probes": {n: vars(p) for n, p in r.probes.items()}, "probe_error": r.probe_errors(),
            "unavailable": r.unavailable,
        } for r in results],
        "rows": [row for r in results for row in step_rows(r, names)],
        "micro": [{"act": r.act, "dtype": r.dtype, "numel": r.numel,
                   "stats_ms": {n: s.to_dict() for n, s in r.stats.items()}, "bytes": r.nbytes,
                   "grad_err": r.grad_err, "grad_tolerance": r.grad_tolerance, "unavailable": r.unavailable}
                  for r in micro],
        "micro_rows": [row for r in micro for row in micro_rows(r)],
        "targets": checks,
    }


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------


def parse_list(text: str) -> list[str]:
    """Comma-separated values, empty items dropped."""
    return [v.strip() for v in text.split(",") if v.strip()]


def parse_args():
    """Shared harness options plus the models, activations, candidates and sizes (defaults from --quick)."""
    p = harness.make_parser(__doc__.splitlines()[0])
    p.add_argument("--parts", default=",".join(PARTS), help=f"which parts (default {','.join(PARTS)})")
    p.add_argument("--models", default=",".join(MODEL_NAMES), help=f"models (default {','.join(MODEL_NAMES)})")
    p.add_argument("--acts", default=None,
                   help="activations for every model (default per model: "
                        + "; ".join(f"{m} {','.join(a)}" for m, a in DEFAULT_ACTS.items()) + "; quick "
                        + "; ".join(f"{m} {','.join(a)}" for m, a in QUICK_ACTS.items())
                        + f"); micro: the union; known {','.join(models.ACTIVATIONS)}")
    p.add_argument("--candidates", default=",".join(CANDIDATES),
                   help="step candidates (default all; native and checkpointed are the ratios' references)")
    p.add_argument("--batch", type=int, default=None,
                   help=f"batch size (default {FULL['batch']}; quick {QUICK['batch']})")
    p.add_argument("--image-size", type=int, default=None,
                   help=f"ResNet image size (default {FULL['image_size']}; quick {QUICK['image_size']})")
    p.add_argument("--bert-layers", type=int, default=None,
                   help=f"BERT encoder layers (default {FULL['bert_layers']}; quick {QUICK['bert_layers']})")
    p.add_argument("--seq-len", type=int, default=128, help="BERT sequence length (default 128)")
    p.add_argument("--amp", action="store_true", help="run the steps part under torch.autocast(bfloat16)")
    p.add_argument("--bytes-only", action="store_true",
                   help="steps part: saved bytes only, no timing, peaks or batch search (e.g. --amp on a "
                        "CPU without fast bf16, where a step takes seconds)")
    p.add_argument("--mem-cap-gib", type=float, default=10.0,
                   help="CUDA: memory cap of the largest-batch search, GiB (default 10; 0 skips the search)")
    p.add_argument("--micro-reps", type=int, default=None,
                   help=f"timed rounds of the micro part (default {FULL['micro_reps']}; quick {QUICK['micro_reps']})")
    p.add_argument("--micro-log2", type=int, default=None,
                   help="log2 of the micro tensor's elements (default 24 on CUDA, 22 on CPU, 20 quick)")
    args = p.parse_args()
    defaults = QUICK if args.quick else FULL
    for key in ("batch", "image_size", "bert_layers", "reps", "warmup", "micro_reps"):
        if getattr(args, key) is None:
            setattr(args, key, defaults[key])
    if args.micro_log2 is None:
        args.micro_log2 = MICRO_LOG2["quick" if args.quick else args.device]
    args.parts = parse_list(args.parts)
    args.models = parse_list(args.models)
    args.candidates = parse_list(args.candidates)
    args.acts = parse_list(args.acts) if args.acts else None
    for what, given, known in (("--parts", args.parts, PARTS), ("--models", args.models, MODEL_NAMES),
                               ("--acts", args.acts or [], models.ACTIVATIONS),
                               ("--candidates", args.candidates, CANDIDATES)):
        unknown = [v for v in given if v not in known]
        if unknown:
            p.error(f"{what}: unknown {', '.join(unknown)}; known: {', '.join(known)}")
    return args


def model_acts(model: str, args) -> tuple[str, ...]:
    """The activations ``model`` runs with: --acts, or its defaults (fewer with --quick)."""
    return tuple(args.acts) if args.acts else (QUICK_ACTS if args.quick else DEFAULT_ACTS)[model]


def plan_cases(args) -> list[Case]:
    return [Case(m, a) for m in args.models for a in model_acts(m, args)]


def micro_acts(args) -> list[str]:
    """The activations of the micro part: those of the selected models' cases, in ACTIVATIONS order."""
    wanted = {a for m in args.models for a in model_acts(m, args)}
    return [a for a in models.ACTIVATIONS if a in wanted]


def main() -> None:
    args = parse_args()
    device = harness.setup_device(args)
    info = harness.machine_info(device)
    results, micro = [], []
    if "steps" in args.parts:
        for case in plan_cases(args):
            print(f"... {case.label}", file=sys.stderr, flush=True)
            results.append(run_case(case, args.candidates, device, args))
    if "micro" in args.parts:
        for act in micro_acts(args):
            for dtype in MICRO_DTYPES:
                print(f"... micro {act} {dtype}", file=sys.stderr, flush=True)
                micro.append(run_micro(act, dtype, 2**args.micro_log2, device, args))
    checks = [c for r in results for c in step_targets(r, args.amp)] + [c for r in micro for c in micro_targets(r)]
    print_report(results, micro, checks, args.candidates, info, args)
    harness.write_json(args.json, json_payload(results, micro, checks, args.candidates, info, args))
    harness.exit_if_failed(check_failed(results, micro, args.amp))


if __name__ == "__main__":
    main()
