"""Stages whose module the user wrapped in torch DDP or FSDP2 (`fully_shard`) over the data-parallel
group: the executor drives the wrapper through these events, and DDP/FSDP2 do every collective.

The recipe is torch.distributed.pipelining's (stage.py: `forward_maybe_with_nosync`,
`backward_maybe_with_nosync`, `perform_reduce_grad`; schedules.py: UNSHARD/RESHARD), except that
DDP's buffers are broadcast at each step's first forward (as plain DDP does; torch's pipelining
broadcasts them once), FSDP2 reshards at RESHARD rather than inside REDUCE_GRAD, and gradients
can be summed over the replicas (average=False: FSDP2 reduce-scatters with SUM; a DDP stage gets a
comm hook that sums, unless its module has a hook of the user's, whose mean is then multiplied back
by the dp size: exact only for a power of two).

Each microbatch's backward is a normal autograd-engine call, so DDP's and FSDP2's autograd hooks
(grad-accumulator hooks, pre-backward tensor hooks, post-backward nodes, queued final callbacks) run
as in `loss.backward()`; the events only set the flags that say which backward is the last. The
gradients .grad held before a step are taken as already reduced (an earlier step's): the step adds
its own reduced contribution to them, as `loss.backward()` twice would; a failed step leaves .grad
as it was before the step.
"""

from __future__ import annotations

import sys
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from pipecore.errors import InputError, PipelineError


def _fsdp_module() -> type | tuple:
    """FSDP2's module class, once torch.distributed.fsdp is imported (no module can be one before);
    importing it here would cost every Pipeline seconds."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return getattr(fsdp, "FSDPModule", ()) if fsdp is not None else ()


def fsdp_states(module: torch.nn.Module) -> list[tuple[torch.nn.Module, object]]:
    """Each FSDP2 state in `module`'s tree once, with the first of its modules (in module order).
    One `fully_shard([norm, head])` call over a list of modules makes ONE state that every module
    of the list reaches (TorchTitan wraps its norm and head so): collected per module, its parameter
    groups, and so each parameter and its set-aside gradient, would count once per module."""
    FSDPModule = _fsdp_module()
    found: dict[int, tuple[torch.nn.Module, object]] = {}
    for m in module.modules():
        if isinstance(m, FSDPModule):
            state = m._get_fsdp_state()
            found.setdefault(id(state), (m, state))
    return list(found.values())


def fsdp_param_groups(module: torch.nn.Module) -> list:
    """Every FSDP2 parameter group in `module`'s tree, each once."""
    return [g for _, state in fsdp_states(module) for g in state._fsdp_param_groups]


def _ranks(group) -> list[int]:
    return sorted(dist.get_process_group_ranks(group))


class WrappedStage:
    """What the executor calls, per stage, around a training step (see `of`)."""

    kind: str = ""
    sharded: bool = False

    def __init__(self, module: torch.nn.Module, dp_group):
        self.module = module
        self.dp_size = dist.get_world_size(dp_group)
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._stash: list | None = None

    def _set_aside_grads(self, copy: bool = False) -> None:
        """.grad as before the step goes aside (the wrapper reduces only the step's gradients) until
        end_step adds it back, or after a failed step puts it back alone."""
        self._stash = None
        if any(p.grad is not None for p in self._params):
            self._stash = [p.grad.clone() if copy and p.grad is not None else p.grad for p in self._params]
            for p in self._params:
                p.grad = None

    def _put_back_grads(self, failed: bool) -> None:
        stash, self._stash = self._stash, None
        if failed:  # .grad as before the step
            for i, p in enumerate(self._params):
                p.grad = None if stash is None else stash[i]
            return
        if stash is not None:
            for p, g in zip(self._params, stash):
                if g is not None:
                    if p.grad is None:
                        p.grad = g
                    else:
                        p.grad.add_(g)

    @staticmethod
    def is_wrapped(module: torch.nn.Module) -> bool:
        """Is `module` itself a DDP or FSDP2 module?"""
        return isinstance(module, DistributedDataParallel) or isinstance(module, _fsdp_module())

    @staticmethod
    def of(module: torch.nn.Module, dp_group) -> WrappedStage | None:
        """The adapter for a stage module wrapped in DDP or FSDP2, None for a plain module. Raises
        InputError for a wrapper pipecore cannot drive exactly (the message says what to change)."""
        if isinstance(module, DistributedDataParallel):
            return _DDPStage(module, dp_group)
        FSDPModule = _fsdp_module()
        if isinstance(module, FSDPModule):
            return _FSDPStage(module, dp_group)
        inner = [name for name, m in module.named_modules() if isinstance(m, (DistributedDataParallel, FSDPModule))]
        if inner:
            raise InputError(
                f"stage module {type(module).__name__} is not wrapped, but its submodule '{inner[0]}' is "
                f"({type(module.get_submodule(inner[0])).__name__}): pipecore drives a data-parallel wrapper only "
                "on the stage's own module (a nested one would reduce its gradients at every microbatch and then "
                "again with the plain stages'). Wrap the stage module itself: DDP(stage_module, "
                "process_group=dp_group), or fully_shard(stage_module, mesh=dp_mesh) after fully_shard on its layers")
        return None

    @staticmethod
    def common_group(modules: list[torch.nn.Module]):
        """The data-parallel group that the DDP/FSDP2-wrapped modules among `modules` reduce over
        (DDP's process_group, FSDP2's 1-D mesh), None when none is wrapped. A group of this rank alone
        counts (TorchTitan wraps in FSDP2 at dp=1): the wrapper is driven by the step's events at any
        size, or its hooks would reduce at the end of each input backward, before that microbatch's
        weight backward (W) ran. Raises InputError when they reduce over different groups, or over a
        mesh of more dimensions (HSDP), where the Pipeline needs dp_group."""
        found: dict[tuple[int, ...], object] = {}
        FSDPModule = _fsdp_module()
        for module in modules:
            if isinstance(module, DistributedDataParallel):
                groups = [module.process_group]
            elif isinstance(module, FSDPModule):
                meshes = {id(g.mesh_info.mesh): g.mesh_info.mesh for g in fsdp_param_groups(module)}.values()
                if any(mesh.ndim != 1 for mesh in meshes):
                    raise InputError("the stage module is wrapped in fully_shard over a mesh of several dimensions: "
                                     "pass Pipeline(..., dp_group=) the group of the data-parallel replicas")
                groups = [mesh.get_group() for mesh in meshes]
            else:
                continue
            for group in groups:
                found.setdefault(tuple(_ranks(group)), group)
        if len(found) > 1:
            raise InputError(f"this rank's wrapped stage modules reduce over different groups (ranks "
                             f"{' and '.join(str(list(r)) for r in found)}): wrap every stage over the one "
                             "data-parallel group, or pass Pipeline(..., dp_group=)")
        return next(iter(found.values()), None)

    def _check_group(self, wrapper: str, ranks: list[int] | None, dp_group, fix: str) -> None:
        if dp_group is None:  # a Pipeline takes the wrapper's group (common_group): only a direct call gets here
            raise InputError(f"the stage module is wrapped in {wrapper}, but no dp_group was given: pass "
                             "dp_group=mesh.get_group('dp'), the group the wrapper reduces over")
        if ranks != _ranks(dp_group):
            raise InputError(f"the stage module's {wrapper} reduces over ranks {ranks}, but the Pipeline's dp_group "
                             f"is ranks {_ranks(dp_group)}: {fix}")

    def forward_context(self):
        return nullcontext()

    def begin_step(self) -> None: ...

    def unshard(self) -> None: ...

    def reshard(self) -> None: ...

    def before_last_backward(self) -> None: ...

    def reduce_grad(self, average: bool) -> None: ...

    def end_step(self, failed: bool) -> None: ...


class WrapperEvents:
    """The DDP/FSDP2-wrapped stages of one Pipeline, driven through the step's events at any dp size
    (the wrapper's group, this rank alone included): whole backwards at I, gradient accumulation
    without communication, the reduction at REDUCE_GRAD after the stage's last W. Left to their own
    hooks, FSDP2's reduce at the end of each input backward, before that microbatch's W ran (issue
    49: TorchTitan wraps in FSDP2 at dp=1)."""

    def __init__(self, stages: list, dp_group):
        self.wrapped: dict[int, WrappedStage] = {}  # local stage -> its adapter
        for local, stage in enumerate(stages):
            adapter = WrappedStage.of(stage.module, dp_group)
            if adapter is not None:
                self.wrapped[local] = adapter
        self.sharded = frozenset(stages[local].stage_index for local, a in self.wrapped.items() if a.sharded)

    def attach(self, executor) -> None:
        """The executor calls event() for these stages (weakly: its callback must not keep the
        Pipeline alive, a cycle through C++)."""
        import weakref

        event = weakref.WeakMethod(self.event)
        executor.set_stage_events(sorted(self.wrapped), lambda kind, local: event()(kind, local))

    def event(self, kind: int, local: int) -> None:
        from pipecore.executor.native import STAGE_EVENTS

        adapter = self.wrapped[local]
        if kind == STAGE_EVENTS["UNSHARD"]:
            adapter.unshard()
        elif kind == STAGE_EVENTS["RESHARD"]:
            adapter.reshard()
        elif kind == STAGE_EVENTS["LAST_BACKWARD"]:
            adapter.before_last_backward()
        elif kind == STAGE_EVENTS["REDUCE_GRAD"]:
            adapter.reduce_grad(average=False)  # the 1/dp is in the loss seeds

    def begin_step(self) -> None:
        for adapter in self.wrapped.values():
            adapter.begin_step()

    def end_step(self, failed: bool) -> None:
        for adapter in self.wrapped.values():
            adapter.end_step(failed=failed)


class _DDPStage(WrappedStage):
    kind = "ddp"
    sharded = False

    def __init__(self, module: DistributedDataParallel, dp_group):
        super().__init__(module, dp_group)
        self._check_group("DistributedDataParallel", _ranks(module.process_group), dp_group,
                          "construct it as DDP(module, process_group=mesh.get_group('dp'))")
        if module.find_unused_parameters:
            # the reducer searches the last backward's graph from its stage outputs to find unused
            # parameters; without them (prepare_for_backward([])) it takes every parameter as unused
            raise InputError("DDP(find_unused_parameters=True) is not supported on a pipeline stage: construct "
                             "it with find_unused_parameters=False (every parameter of a stage must get a gradient "
                             "in each microbatch's backward)")
        if module.static_graph:
            # static_graph's first iteration queues the all-reduce from the first backward that
            # runs (_DDPSink), a microbatch before the last
            raise InputError("DDP(static_graph=True) is not supported on a pipeline stage: construct it with "
                             "static_graph=False")
        self._armed = False
        self._reached = 0
        self._hooks: list = []
        # DDP's own reduction divides each gradient by dp before summing; pipecore wants the sum (the
        # mean over replicas is in the loss seeds), and x / dp * dp is exact only for a power-of-two
        # dp. A comm hook that sums takes DDP's place, unless the user registered a hook of their own
        # (DDP takes one): then their mean is multiplied back by dp.
        hooks = [hook for hook, _ in getattr(module, "_comm_hooks", [])]
        if not hooks:
            module.register_comm_hook(module.process_group, _sum_hook)
        self._sums = not hooks or hooks == [_sum_hook]

    def forward_context(self):
        # Every forward runs with gradient sync off (torch: forward_maybe_with_nosync): DDP's
        # _post_forward would otherwise call reducer.prepare_for_backward, arming the reducer for
        # whichever backward runs next, while other microbatches' graphs are alive.
        return self.module.no_sync()

    def begin_step(self) -> None:
        # The reducer reduces all of .grad: what it held before the step goes aside, so that only
        # the step's gradients are reduced (summed over the replicas). The reduction writes a
        # bucket view's memory: copy those.
        self._set_aside_grads(copy=self.module.gradient_as_bucket_view)

    def before_last_backward(self) -> None:
        # Arms the reducer for exactly this backward, as torch's backward_maybe_with_nosync does
        # for its last microbatch: the grad-accumulator hooks then fill the buckets, all-reduce them
        # while the backward runs (bucket order), and the queued finalize_backward waits for the
        # all-reduces and writes the averaged gradients into .grad before the engine call returns.
        # The earlier backwards ran with the reducer disarmed: their hooks only accumulated .grad.
        self.module.reducer.prepare_for_backward([])
        self._armed = True
        # A reducer armed after the last backward ran would reduce nothing now and all-reduce in the
        # next step's first backward instead: count the gradients the armed backward accumulates.
        self._reached = 0

        def reached(_):
            self._reached += 1
        self._hooks = [p.register_post_accumulate_grad_hook(reached) for p in self._params]

    def _remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def reduce_grad(self, average: bool) -> None:
        self._remove_hooks()
        if self._params and not self._reached:
            raise PipelineError("REDUCE_GRAD of a DDP stage found no gradient accumulated since "
                                "before_last_backward(): it must run right before the engine call that computes "
                                "the stage's last backward (its parameters' gradients), not after it")
        try:
            # raises when the last backward did not reach every parameter (the buckets of those
            # parameters were never all-reduced)
            self.module.reducer._check_reducer_finalized()
        except RuntimeError as exc:
            raise PipelineError("DDP did not finish its gradient reduction in the stage's last backward: every "
                                "parameter of a DDP stage must get a gradient in the last microbatch's backward (the "
                                f"one DDP's reducer is armed for). DDP says: {exc}") from exc
        self._armed = False
        if average == self._sums:  # the hook summed and a mean is asked for, or the other way round
            for p in self._params:
                if p.grad is not None:
                    p.grad.div_(self.dp_size) if average else p.grad.mul_(self.dp_size)

    def end_step(self, failed: bool) -> None:
        self._remove_hooks()
        if failed:
            if self._armed:
                # a reduction that never finished: the still-armed reducer would all-reduce in the
                # next step's first backward
                self.module.reducer._reset_state()
        self._put_back_grads(failed)
        self._armed = False
        # The next step's first forward broadcasts rank 0's buffers, as after a synced DDP forward
        # (our no_sync forwards cleared the flag; torch's pipelining leaves it cleared).
        self.module.require_forward_param_sync = True


def _drop_unsharded_grad(fsdp_param) -> None:
    """Drops the gradient a failed step accumulated unsharded on an FSDPParam. torch 2.13 and 2.14 keep
    a reduce-dtype copy in `unsharded_accumulated_grad` beside the unsharded parameter's .grad; in 2.15
    that name is a read-only view of the .grad."""
    if not isinstance(getattr(type(fsdp_param), "unsharded_accumulated_grad", None), property):
        fsdp_param.unsharded_accumulated_grad = None
    if hasattr(fsdp_param, "_unsharded_param"):
        fsdp_param._unsharded_param.grad = None


def _sum_hook(group, bucket):
    """A DDP comm hook: the bucket summed over the group (DDP's default divides by its size first)."""
    future = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
    return future.then(lambda done: done.value()[0])


class _FSDPStage(WrappedStage):
    kind = "fsdp"
    sharded = True

    def __init__(self, module, dp_group):
        super().__init__(module, dp_group)
        # one module per FSDP state: unshard() and reshard() act on the state's groups, and a state
        # that several modules reach (fully_shard over a list) must be driven, and counted, once
        self._fsdp = [m for m, _ in fsdp_states(module)]
        self._groups = fsdp_param_groups(module)
        # the sharded parameters (module.parameters() gives the unsharded ones while unsharded)
        self._params = list({id(p.sharded_param): p.sharded_param for g in self._groups for p in g.fsdp_params
                             if p.sharded_param.requires_grad}.values())
        meshes = {id(g.mesh_info.mesh): g.mesh_info.mesh for g in self._groups}
        for mesh in meshes.values():
            self._check_group("fully_shard", sorted(mesh.mesh.flatten().tolist()), dp_group,
                              "call fully_shard(module, mesh=mesh['dp']) with the data-parallel dimension of "
                              "pc.init_mesh")
        self._saved: list | None = None
        self._pending: list = []

    def begin_step(self) -> None:
        # FSDP2's gradient accumulation without communication (torch: backward_maybe_with_nosync):
        # every backward of the step accumulates unsharded gradients (no reduce-scatter), keeps the
        # parameters unsharded for the next microbatch, and does not finalize.
        self._saved = [(g.reduce_grads, g.all_reduce_grads, g.reshard_after_backward) for g in self._groups]
        # the sharded .grad goes aside too: the reduce-scatter would add to it, and a failed step
        # must leave it as it was (a later stage of the step can fail after this one's REDUCE_GRAD)
        self._set_aside_grads()
        self.module.set_requires_gradient_sync(False)
        self.module.set_reshard_after_backward(False)
        self.module.set_is_last_backward(False)

    def unshard(self) -> None:
        # all-gather each FSDP module's parameters once for the step (torch's UNSHARD: every
        # FSDPModule of the stage; unshard() is not recursive). Asynchronous: FSDP waits for it in
        # its pre-forward, so the all-gather runs under whatever the rank computes before.
        self._pending = [m.unshard(async_op=True) for m in self._fsdp]

    def reshard(self) -> None:
        for handle in self._pending:  # an all-gather still writing into the memory reshard frees
            handle.wait()
        self._pending = []
        for m in self._fsdp:
            m.reshard()  # frees the unsharded parameters; no communication

    def reduce_grad(self, average: bool) -> None:
        # torch's perform_reduce_grad: with sync on, post_backward reduce-scatters each group's
        # accumulated unsharded gradient into the sharded .grad (set aside at begin_step), and the
        # root's final callback (is_last_backward) waits for the reductions and clears the step's
        # backward state. average=False: the divide factor 1 makes it a sum.
        self.module.set_requires_gradient_sync(True)
        self.module.set_is_last_backward(True)
        saved = [(g.gradient_divide_factor, g.force_sum_reduction_for_comms) for g in self._groups]
        if not average:
            for g in self._groups:
                # divide by 1 after a SUM reduce-scatter (a divide factor alone picks PREMUL_SUM,
                # which gloo refuses: "Cannot use ReduceOp.PREMUL_SUM with Gloo")
                g.gradient_divide_factor, g.force_sum_reduction_for_comms = 1.0, True
        try:
            for group in self._groups:  # each group once (fsdp_states)
                group.post_backward()
            self.module._get_fsdp_state()._root_post_backward_final_callback()
        finally:
            for g, (factor, force_sum) in zip(self._groups, saved):
                g.gradient_divide_factor, g.force_sum_reduction_for_comms = factor, force_sum

    def end_step(self, failed: bool) -> None:
        if failed:
            # waits for in-flight collectives, reshards and clears FSDP's iteration state; the
            # step's unsharded gradients (kept on the unsharded parameters) are dropped as well.
            # A root that never ran a forward (lazy init sets _is_root) has no state to reset.
            if self.module._get_fsdp_state()._is_root is not None:
                self.module.reset_iter_state()
            self._pending = []
            for g in self._groups:
                for p in g.fsdp_params:
                    _drop_unsharded_grad(p)
        else:
            # a module left unsharded would compute with stale parameters after the optimizer step
            self.reshard()
        self._put_back_grads(failed)
        if self._saved is not None:
            for g, (reduce, all_reduce, reshard_after) in zip(self._groups, self._saved):
                g.reduce_grads, g.all_reduce_grads, g.reshard_after_backward = reduce, all_reduce, reshard_after
        self.module.set_is_last_backward(True)
        self._saved = None
