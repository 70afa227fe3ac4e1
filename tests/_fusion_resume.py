"""Fresh-process worker for tests/test_fusion.py (not a test module).

    python _fusion_resume.py resume CASE OPT CKPT START STOP OUT
        Build CASE's model and OPT (two groups, OneCycleLR) as test_fusion's
        Trainer does, load the checkpoint CKPT (model, optimizer, scheduler,
        RNG state), fuse in forward mode, train micro-batches START..STOP-1
        and torch.save the Result (as a dict) to OUT.

    python _fusion_resume.py ddp RANK WORLD INIT_FILE OUT
        One rank of a gloo DistributedDataParallel run (init_method
        file://INIT_FILE): 20 steps of DDP + eager step(), then 20 steps of
        reprop.fuse(DDP(model), opt, mode="backward") from the same start, each
        rank on its own data; then both again accumulating 2 micro-batches
        under no_sync() (accumulation_steps=2); then the lifetimes of
        ddp_lifetimes; torch.save {"eager": ..., "fused": ..., "eager_acc":
        ..., "fused_acc": ..., "freed": ..., "grads_after_remove": ...} to OUT.

    python _fusion_resume.py ddp_unused RANK WORLD INIT_FILE OUT
        DDP(find_unused_parameters=True) of a model whose `aux` layer no rank
        uses in most steps and one rank alone uses in one, eager step() and
        reprop.fuse(mode="backward") (gradient_as_bucket_view False and True);
        torch.save {"eager": ..., "fused": ..., ...} to OUT.

    python _fusion_resume.py ddp_unused_zeroed RANK WORLD INIT_FILE OUT
        ddp_unused with zero_grad(set_to_none=False), whose zero gradients
        eager step() moves a parameter no rank used from; also with a
        no_grad forward before each step() (the keys ending in "_eval").

    python _fusion_resume.py ddp_used_elsewhere RANK WORLD INIT_FILE OUT
        DDP(find_unused_parameters=True) of _SometimesAux, parameters one rank
        alone used in a step: backward mode in a loop that never calls step()
        against eager DDP stepping; and only `aux` fused with keep_grads=True,
        rank 1 never using it (its backward gives no fused parameter a
        gradient); torch.save {name: (fused, eager)} to OUT, each a dict of the
        parameters and the .grad after each backward ("unfreed": the steps
        whose backward left a fused parameter's gradient unfreed).

    python _fusion_resume.py ddp_acc_unused RANK WORLD INIT_FILE OUT
        DDP(find_unused_parameters=True) of _SometimesAux, only `aux` in the
        optimizer, accumulating 2 micro-batches under no_sync(), rank 1
        using aux only in the all-reduced one (its no_sync() backward gives
        no fused parameter a gradient): eager step(), and
        reprop.fuse(mode="backward", accumulation_steps=2) in a loop calling
        step() and in one not; torch.save {"eager": ..., "fused_step": ...,
        "fused_no_step": ...} to OUT, each aux's parameters and whether its
        gradients were freed right after each all-reduced backward.

    python _fusion_resume.py ddp_twice RANK WORLD INIT_FILE OUT
        reprop.fuse(DDP(model), mode="backward") and two backward() calls of
        one forward (the second reaching only an Embedding's weight, which
        autograd does not save); torch.save {"error": its message or None}.

    python _fusion_resume.py ddp_comm_hook RANK WORLD INIT_FILE OUT
        DDP with a communication hook (fp16 compression, PowerSGD, one whose
        result is a new tensor): registered with DDP and eager step(), and
        passed to reprop.fuse(mode="backward", comm_hook=...); then fuse()
        of a DDP model with a hook registered already (Python's, built-in);
        torch.save {(hook, fused): final parameters, "refusals": ...} to OUT.

    python _fusion_resume.py ddp_join RANK WORLD INIT_FILE OUT
        Uneven inputs under torch's Join([ddp]) (rank r trains 2 + r steps):
        eager step(), reprop.fuse(mode="backward") and mode="forward";
        torch.save {mode: the final parameters} to OUT.

Runs as a script, so this directory is sys.path[0] and test_fusion imports.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import itertools
import os
import sys
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F

import test_fusion as tf


def resume(case: str, opt_name: str, ckpt: str, start: int, stop: int, out: str) -> None:
    loop = tf.Loop(scheduler=True)
    t = tf.Trainer(case, opt_name, "forward", loop, total=tf.STEPS, checkpoint=torch.load(ckpt))
    result = t.run(start, stop).finish()
    t.handle.remove()
    torch.save(dataclasses.asdict(result), out)


DDP_STEPS = 20


def ddp(rank: int, world: int, init_file: str, out: str) -> None:
    import reprop
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    case = tf.CASES["cnn"]
    results = {}
    # "_acc": DDP's accumulation loop, no_sync() but every second micro-batch
    for kind in ("eager", "fused", "eager_acc", "fused_acc"):
        every = 2 if kind.endswith("_acc") else 1
        torch.manual_seed(1234 + rank)  # dropout masks differ per rank, equal between the two runs
        model = DDP(case.make_model())
        opt = tf.make_optimizer(model, "AdamW")
        handle = None
        if kind.startswith("fused"):
            handle = reprop.fuse(model, opt, mode="backward", accumulation_steps=every)
        for i in range(DDP_STEPS):
            x, y = case.batch(1000 * rank + i)
            last = (i + 1) % every == 0
            with contextlib.nullcontext() if last else model.no_sync():
                (F.mse_loss(model(x), y) / every).backward()
            if last:
                opt.step()
                opt.zero_grad()
        if handle is not None:
            handle.flush()
        r = tf.Result(
            params={n: p.detach().clone() for n, p in model.named_parameters()},
            buffers={n: b.detach().clone() for n, b in model.named_buffers()},
            state=tf.optimizer_state(model, opt),
        )
        if handle is not None:
            handle.remove()
        results[kind] = dataclasses.asdict(r)
    results.update(ddp_lifetimes(rank))
    torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


def ddp_lifetimes(rank: int) -> dict:
    """"freed": whether DDP(model), its optimizer and a backward-mode fusion,
    dropped without remove(), are freed (DDP's C++ Reducer keeps the comm
    hook out of the garbage collector's sight). "grads_after_remove": the
    gradients of a backward after remove() and dropping the handle (the comm
    hook, which DDP cannot unregister, must still all-reduce)."""
    import reprop
    from torch.nn.parallel import DistributedDataParallel as DDP

    case = tf.CASES["cnn"]

    def fused_ddp():
        model = DDP(case.make_model())
        opt = tf.make_optimizer(model, "AdamW")
        handle = reprop.fuse(model, opt, mode="backward")
        for i in range(3):
            x, y = case.batch(1000 * rank + i)
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        return model, opt, handle

    model, opt, handle = fused_ddp()
    alive = weakref.ref(model)
    del model, opt, handle
    gc.collect()
    freed = alive() is None
    model, opt, handle = fused_ddp()
    handle.remove()
    del handle
    gc.collect()
    x, y = case.batch(1000 * rank + 3)
    F.mse_loss(model(x), y).backward()
    return {"freed": freed, "grads_after_remove": {n: p.grad.clone() for n, p in model.named_parameters()}}


class _SometimesAux(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(4, 4)
        self.aux = torch.nn.Linear(4, 4)

    def forward(self, x, use_aux: bool):
        h = self.body(x)
        return h + self.aux(h) if use_aux else h


def ddp_unused(rank: int, world: int, init_file: str, out: str, set_to_none: bool = True) -> None:
    import reprop
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = {}
    for as_view, evaluate, kind in itertools.product(
            (False, True), (False,) if set_to_none else (False, True), ("eager", "fused")):
        model = DDP(_SometimesAux(), find_unused_parameters=True,
                    gradient_as_bucket_view=as_view)
        opt = reprop.optim.Adam(model.parameters(), lr=0.01)
        handle = reprop.fuse(model, opt, mode="backward") if kind == "fused" else None
        for i in range(4):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * rank + i))
            # step 0: every rank uses aux; step 2: rank 0 alone; else none
            use_aux = i == 0 or (i == 2 and rank == 0)
            model(x, use_aux).square().mean().backward()
            if evaluate:
                with torch.no_grad():
                    model(x, True)
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
        if handle is not None:
            handle.remove()
        r = tf.Result(params={n: p.detach().clone() for n, p in model.named_parameters()},
                      buffers={}, state=tf.optimizer_state(model, opt))
        results[kind + "_view" * as_view + "_eval" * evaluate] = dataclasses.asdict(r)
    torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


def _used_elsewhere_run(rank: int, fused: bool, as_view: bool, aux_only: bool) -> dict:
    """One training of ddp_used_elsewhere's (see the module docstring)."""
    import reprop
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_SometimesAux(), find_unused_parameters=True, gradient_as_bucket_view=as_view,
                bucket_cap_mb=1e-5)  # (a bucket per parameter)
    trained = list(model.module.aux.parameters() if aux_only else model.parameters())
    opt = reprop.optim.Adam(trained, lr=0.01)
    handle = reprop.fuse(model, opt, mode="backward", keep_grads=aux_only) if fused else None
    grads, unfreed = [], []
    for i in range(5):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * rank + i))
        if aux_only:  # rank 0 uses aux in most steps, rank 1 never
            use_aux = rank == 0 and i != 1
        else:  # every rank in step 0; then rank 0 alone in step 2, rank 1 alone in step 3
            use_aux = i == 0 or (i == 2 and rank == 0) or (i == 3 and rank == 1)
        model(x, use_aux).square().mean().backward()
        grads.append([None if p.grad is None else p.grad.clone() for p in trained])
        if fused and not aux_only and any(p.grad is not None for p in trained):
            unfreed.append(i)
        if aux_only:  # (the others are in no optimizer)
            model.module.body.zero_grad()
        if not fused or aux_only:  # (backward mode's loop need not step)
            opt.step()
            opt.zero_grad()
    if handle is not None:
        handle.remove()
    return {"params": [p.detach().clone() for p in model.parameters()], "grads": grads,
            "unfreed": unfreed}


def ddp_used_elsewhere(rank: int, world: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = {}
    for as_view, aux_only in itertools.product((False, True), (False, True)):
        results[f"view={as_view}, aux_only={aux_only}"] = tuple(
            _used_elsewhere_run(rank, fused, as_view, aux_only) for fused in (True, False))
    torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


def ddp_acc_unused(rank: int, world: int, init_file: str, out: str) -> None:
    import reprop
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = {}
    for kind in ("eager", "fused_step", "fused_no_step"):
        model = DDP(_SometimesAux(), find_unused_parameters=True)
        opt = reprop.optim.Adam(model.module.aux.parameters(), lr=0.01)
        handle = (reprop.fuse(model, opt, mode="backward", accumulation_steps=2)
                  if kind != "eager" else None)
        freed = []
        for i in range(8):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * rank + i))
            last = i % 2 == 1
            with contextlib.nullcontext() if last else model.no_sync():
                (model(x, rank == 0 or last).square().mean() / 2).backward()
            model.module.body.zero_grad()  # (in no optimizer)
            if last:
                freed.append(all(p.grad is None for p in model.module.aux.parameters()))
                if kind != "fused_no_step":
                    opt.step()
                    opt.zero_grad()
        if handle is not None:
            handle.remove()
        results[kind] = {"params": [p.detach().clone() for p in model.module.aux.parameters()],
                         "freed": freed}
    torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


class _EmbeddingHead(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, tokens):
        e = self.emb(tokens)
        return self.head(torch.tanh(e)), e


def ddp_twice(rank: int, world: int, init_file: str, out: str) -> None:
    import reprop
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    model = DDP(_EmbeddingHead())
    handle = reprop.fuse(model, reprop.optim.SGD(model.parameters(), lr=0.1), mode="backward")
    out_, e = model(torch.randint(0, 10, (6,), generator=torch.Generator().manual_seed(rank)))
    out_.square().mean().backward(retain_graph=True)
    error = None
    try:
        e.square().mean().backward()
    except RuntimeError as exc:
        error = str(exc)
    handle.remove()
    torch.save({"error": error}, out)
    # The backward that raised left DDP's reducer mid-iteration: torch's own
    # teardown of it, at exit after the process group is gone, aborted one
    # rank now and then under load ("terminate called without an active
    # exception", twice in CI). It is freed while both ranks are still in the
    # group, and the process ends without the interpreter's teardown.
    del handle, model, out_, e
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def ddp_join(rank: int, world: int, init_file: str, out: str) -> None:
    import reprop
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = {}
    for mode in (None, "backward", "forward", "forward, Join first"):
        model = DDP(tf._mlp())
        opt = reprop.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        first = mode == "forward, Join first"  # the Join then holds DDP's own join hook
        join = Join([model]) if first else None
        handle = reprop.fuse(model, opt, mode="forward" if first else mode) if mode else None
        with join or Join([model]):
            for i in range(2 + rank):
                x, y = tf._mlp_batch(10 * rank + i)
                F.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
        if handle is not None:
            handle.remove()
        results[str(mode)] = [p.detach().clone() for p in model.parameters()]
    torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


def _mean_into_copy_hook(state, bucket):
    """A DDP comm hook whose result is a new tensor, not the bucket's buffer
    (DDP copies it there once backward ends)."""
    mean = bucket.buffer().div(dist.get_world_size())
    return dist.all_reduce(mean, async_op=True).get_future().then(lambda fut: fut.value()[0])


def _comm_hooks() -> dict:
    """name -> a function making (hook, state), a new state per run."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    def powersgd():  # compressing from the third step on, error feedback
        return powerSGD_hook.powerSGD_hook, powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2,
            min_compression_rate=0.5)
    return {"fp16": lambda: (default_hooks.fp16_compress_hook, None),
            "copy": lambda: (_mean_into_copy_hook, None), "powersgd": powersgd}


def _mlp_steps(model, opt, rank: int, steps: int, before=None) -> None:
    """`steps` steps of the eager loop on rank's own batches of tf._mlp's
    data; before(i) first."""
    for i in range(steps):
        if before is not None:
            before(i)
        x, y = tf._mlp_batch(10 * rank + i)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def ddp_comm_hook(rank: int, world: int, init_file: str, out: str) -> None:
    import reprop
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = {}
    for name, make in _comm_hooks().items():
        for fused in (False, True):
            torch.manual_seed(0)
            model = DDP(tf._mlp())
            opt = reprop.optim.Adam(model.parameters(), lr=0.01)
            hook, state = make()
            if fused:
                handle = reprop.fuse(model, opt, mode="backward", comm_hook=hook, comm_state=state)
            else:
                model.register_comm_hook(state, hook)
            _mlp_steps(model, opt, rank, 5)
            if fused:
                handle.remove()
            results[(name, fused)] = [p.detach().clone() for p in model.parameters()]
    # DDP on a group of its own rank: the all-reduce is DDP's group's, not WORLD's
    # (also the fallback once the handle is removed and dropped)
    own = [dist.new_group([r]) for r in range(world)][rank]
    for fused in (False, True):
        torch.manual_seed(0)
        model = DDP(tf._mlp(), process_group=own)
        opt = reprop.optim.SGD(model.parameters(), lr=0.1)
        handles = [reprop.fuse(model, opt, mode="backward")] if fused else []

        def drop_at_third_step(i):
            if i == 2 and handles:
                handles.pop().remove()
                gc.collect()
        _mlp_steps(model, opt, rank, 4, drop_at_third_step)
        results[("own group", fused)] = [p.detach().clone() for p in model.parameters()]
    # a hook registered with DDP first, Python's or a built-in: refused, DDP as it was
    refusals = {}
    model = DDP(tf._mlp())
    try:  # DDP's own check of a hook's signature: it sees only the fusion's
        reprop.fuse(model, reprop.optim.SGD(model.parameters(), lr=0.1), comm_hook=lambda b: b)
    except ValueError as exc:
        refusals["signature"] = str(exc)
    for name in ("python", "builtin", "refused"):
        model = DDP(tf._mlp())
        if name == "python":
            model.register_comm_hook(None, _mean_into_copy_hook)
        elif name == "builtin":
            model._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
        else:  # an earlier fusion's, removed: DDP cannot unregister it
            reprop.fuse(model, reprop.optim.SGD(model.parameters(), lr=0.1)).remove()
        hooks = list(model._comm_hooks)
        try:
            reprop.fuse(model, reprop.optim.SGD(model.parameters(), lr=0.1), mode="backward")
            refusals[name] = None
        except ValueError as exc:
            refusals[name] = (str(exc), model._comm_hooks == hooks)
    results["refusals"] = refusals
    torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


DDP_COMMANDS = {
    "ddp_comm_hook": ddp_comm_hook,
    "ddp": ddp,
    "ddp_unused": ddp_unused,
    "ddp_unused_zeroed": functools.partial(ddp_unused, set_to_none=False),
    "ddp_acc_unused": ddp_acc_unused,
    "ddp_twice": ddp_twice,
    "ddp_join": ddp_join,
    "ddp_used_elsewhere": ddp_used_elsewhere,
}


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    cmd, *args = argv
    if cmd == "resume":
        case, opt_name, ckpt, start, stop, out = args
        resume(case, opt_name, ckpt, int(start), int(stop), out)
    elif cmd in DDP_COMMANDS:
        rank, world, init_file, out = args
        DDP_COMMANDS[cmd](int(rank), int(world), init_file, out)
    else:
        raise SystemExit(f"unknown command {cmd!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
