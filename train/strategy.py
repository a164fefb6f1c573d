"""How a replica computes and reduces its gradients: the strategies behind `Elastic`.

Both keep what `Elastic` promises whatever the world size: the step's B samples are
counted once, the gradient applied is the sum of every sample's gradient divided by B, and
the step is atomic (every rank applies it or none does).

- `DataParallel`: every worker holds the whole model. Each micro-batch's gradient, divided
  by the global batch as it lands, is accumulated into flat buckets (about `bucket_mb`
  each, parameters in reverse order, as DDP's reducer lays them out) and each bucket's
  all-reduce starts during the last micro-batch's backward pass, as soon as its gradients
  are final, in the same bucket order on every rank. The optimizer steps once every
  bucket's sum has arrived.
- `HybridSharded`: FSDP2's `fully_shard` over the workers of a replica (the shard group:
  the default process group; in live mode a `ShardGroup` that each generation connects
  anew, so that a lost node's shard ranks can be taken by new processes), replicated across
  replicas. FSDP2 reduce-scatters within the replica as the backward pass goes; each
  reduce-scattered gradient shard is then all-reduced across replicas, started from
  FSDP2's all-reduce hook, so that too overlaps the backward pass. The cross-replica
  dimension is the elastic one.

A strategy never decides anything about worlds; `Elastic` hands it the generation's
cross-replica group (None in a world of one replica) at the start of each step."""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import datetime
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, TypeVar

import torch
import torch.distributed as dist

from tidal.train.backend import select_device, worker_device
from tidal.train.groups import fixed_world_store
from tidal.train.shard_group import ShardGroup
from tidal.train.shard_group import install as install_shard_group
from tidal.train.state import local

ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)
# The first gradient bucket's size (DDP's default first bucket too).
FIRST_BUCKET_BYTES = 1 << 20


class Strategy(abc.ABC):
    # Whether a rank may abandon a step between micro-batches when its launcher says stop.
    # Under HybridSharded it may not: its unit peers would wait in FSDP's collectives.
    stops_within_step: ClassVar[bool]
    # Whether every rank runs the same number of micro-batches (FSDP's collectives within the
    # unit need it): a rank short of samples runs one with weight zero.
    uniform_micro_batches: ClassVar[bool]
    # Whether the step's control all-reduce (its commit vote) must wait until this rank's
    # gradient reduction has completed. Under HybridSharded each shard reduces with its own
    # peers in the other replicas: when a node dies, one shard's reduction can complete while
    # another's fails, and a vote taken earlier would let the first shard's ranks commit the
    # step the others abandon (a replica's shards at two steps). Voting after the reduction,
    # a rank commits only if every rank's reduction completed.
    vote_after_reduction: ClassVar[bool]

    # How the strategy waits on its collectives' works: `Elastic` gives it its
    # `Collectives.wait_work` (gloo waits in slices, interruptible by the launcher's word).
    wait_work: Callable[[Any], None] = staticmethod(lambda work: work.wait())

    @property
    def shard_size(self) -> int:
        """Workers per replica."""
        return 1

    @property
    def shard_rank(self) -> int:
        """This worker's place in its replica."""
        return 0

    @property
    def shard_group(self) -> ShardGroup | None:
        """The replica's swappable shard group, connected by each generation (live mode,
        HybridSharded), or None."""
        return None

    @abc.abstractmethod
    def attach(self, model: torch.nn.Module, params: list[torch.nn.Parameter]) -> None:
        """Called once by `Elastic` with the model and its trainable parameters."""

    @abc.abstractmethod
    def begin_step(self, group: Any, batch: int) -> None:
        """A step of global batch `batch` starts: gradients are cleared; `group` is the
        cross-replica group (None for a world of one replica)."""

    @abc.abstractmethod
    def before_backward(self, last: bool) -> None:
        """The next backward pass is the step's last (its gradients get reduced) or not."""

    def after_backward(self, last: bool) -> None:  # noqa: B027 (a hook with nothing to do by default)
        """The backward pass that `before_backward(last)` announced has returned."""

    @abc.abstractmethod
    def finish(self) -> None:
        """Start what is left of the reduction and wait for all of it: each parameter's
        `grad` is then the sum of every sample's gradient divided by the step's global
        batch. Raises RuntimeError when a collective failed (the step is then abandoned:
        nothing of it is applied)."""

    @abc.abstractmethod
    def abandon(self) -> None:
        """The step will not be applied: drop in-flight reductions and gradients."""

    @torch.no_grad()
    def gradient_norm(self, params: list[torch.nn.Parameter]) -> torch.Tensor | None:
        """After `finish`: the gradients' global 2-norm (over the whole model, every sample
        of the step), the same on every rank; None with no gradient. A sharded gradient's
        norm is completed across the shard group, a collective within the unit: the step
        takes it before its commit vote, so that no collective runs between the vote and
        the optimizer's step (a peer lost there would leave a committed step unapplied)."""
        from torch.distributed.tensor import DTensor

        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return None
        total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if isinstance(total, DTensor):
            total = total.full_tensor()
        return total

    def clip_grad_norm(self, params: list[torch.nn.Parameter], max_norm: float) -> float:
        """`gradient_norm` and `clip_to_norm` at once (as before they were split), for a
        caller with no commit vote between them; returns the norm before clipping."""
        return self.clip_to_norm(params, max_norm, self.gradient_norm(params))

    @staticmethod
    @torch.no_grad()
    def clip_to_norm(params: list[torch.nn.Parameter], max_norm: float, total: torch.Tensor | None) -> float:
        """Scale the gradients so that their norm `total` (`gradient_norm`) is at most
        `max_norm`, on this rank alone; returns the norm before clipping."""
        if total is None:
            return 0.0
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return float(total)


@dataclasses.dataclass
class _Bucket:
    params: list[torch.nn.Parameter]
    flat: torch.Tensor
    views: list[torch.Tensor]


class DataParallel(Strategy):
    """Every worker a whole replica; gradients reduced in buckets during the backward pass.
    `overlap=False` reduces the same buckets after the backward pass instead (for comparison).

    A model of several buckets takes each micro-batch's gradient of a parameter from
    autograd as it is made (a post-accumulate-grad hook); it lands in the parameter's place
    in its bucket already divided by the global batch (the first one of a step written
    there, later ones added): no zeroing of the buckets and no division after the
    reduction. A model that fits one bucket (the first is 1 MiB) has nothing to overlap
    (its only bucket is ready when the backward pass ends) and no hooks: autograd
    accumulates its micro-batches' gradients as usual, and once the last backward pass has
    returned they land in the bucket in one copy and one division (`after_backward`), which
    spares a small model the hooks' per-parameter Python work (DDP's reducer does that
    work in C++). `finish` points every parameter's `grad` at its place."""

    stops_within_step = True
    # Early: the vote overlaps the last backward pass. Voting after the reduction would let a
    # world the launcher announces during a step take effect after it (not after the next
    # one), but adds a serialized all-reduce to every step: tried in 43455a2, on simulated
    # H100s with 4 ranks on 2 cores a step took 0.579 s against 0.562 s (ideal 0.557), and
    # the goodput trace lost more to it than the joiners' shorter wait gained. So the ranks
    # vote late only while a change is on its way: a second vote at the step's end
    # (`Elastic._vote_at_step_end`, since c682000).
    vote_after_reduction = False
    uniform_micro_batches = False

    def __init__(self, bucket_mb: float = 25.0, overlap: bool = True) -> None:
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be positive, not {bucket_mb}")
        self.bucket_bytes = int(bucket_mb * (1 << 20))
        self.overlap = overlap
        self._buckets: list[_Bucket] = []
        # Whether the gradients land through the hooks (more than one bucket).
        self._hooked = False
        self._group: Any = None
        self._scale = 1.0
        self._armed = False
        # Per bucket: which of its parameters got a gradient this step (hooked).
        self._written: list[list[bool]] = []
        # Unhooked: whether this step's gradients have landed in the bucket.
        self._landed = False
        self._pending: list[int] = []
        self._launched = 0
        self._works: list[Any] = []
        self._error: BaseException | None = None
        # Between begin_step and finish/abandon. A backward pass outside a step (a script's
        # own probe, a gradient norm taken by hand) is autograd's alone: .grad accumulates.
        self._in_step = False

    def attach(self, model: torch.nn.Module, params: list[torch.nn.Parameter]) -> None:
        if self._buckets:
            raise RuntimeError("a DataParallel strategy serves one model")
        if any(hasattr(parameter, "to_local") for parameter in params):
            raise ValueError("DataParallel: the model's parameters are sharded (DTensors); a sharded model trains "
                             "with HybridSharded (strategy.shard(model) and Elastic(..., strategy=strategy))")
        # Reverse order: roughly the order in which the backward pass finishes gradients. The
        # first bucket is small (as DDP's): its all-reduce starts early in the backward pass.
        current: list[torch.nn.Parameter] = []
        current_bytes = 0
        for parameter in reversed(params):
            size = parameter.numel() * parameter.element_size()
            cap = min(FIRST_BUCKET_BYTES, self.bucket_bytes) if not self._buckets else self.bucket_bytes
            if current and (current_bytes + size > cap or parameter.dtype != current[0].dtype
                            or parameter.device != current[0].device):
                self._add_bucket(current)
                current, current_bytes = [], 0
            current.append(parameter)
            current_bytes += size
        if current:
            self._add_bucket(current)
        self._hooked = len(self._buckets) > 1
        if self._hooked:
            for index, bucket in enumerate(self._buckets):
                for place, (parameter, view) in enumerate(zip(bucket.params, bucket.views, strict=True)):
                    parameter.register_post_accumulate_grad_hook(self._hook(index, place, view))

    def _add_bucket(self, params: list[torch.nn.Parameter]) -> None:
        offsets = [0]
        for parameter in params:
            offsets.append(offsets[-1] + parameter.numel())
        flat = torch.zeros(offsets[-1], dtype=params[0].dtype, device=params[0].device)
        views = [flat[start:end].view_as(parameter)
                 for parameter, start, end in zip(params, offsets, offsets[1:], strict=False)]
        self._buckets.append(_Bucket(params=params, flat=flat, views=views))

    @property
    def buckets(self) -> int:
        return len(self._buckets)

    def begin_step(self, group: Any, batch: int) -> None:
        if batch <= 0:
            raise ValueError(f"a step's global batch must be positive, not {batch}")
        self._group = group
        self._scale = 1.0 / batch
        self._armed = False
        self._launched = 0
        self._works = []
        self._error = None
        self._landed = False
        if self._hooked:
            self._pending = [len(bucket.params) for bucket in self._buckets]
            self._written = [[False] * len(bucket.params) for bucket in self._buckets]
        self._in_step = True
        for bucket in self._buckets:
            for parameter in bucket.params:
                # Autograd hands each micro-batch's gradient over as a tensor of its own.
                parameter.grad = None

    def before_backward(self, last: bool) -> None:
        self._armed = last and self.overlap and self._group is not None

    def after_backward(self, last: bool) -> None:
        if last and not self._hooked and self._in_step and not self._landed:
            # The only bucket is ready: its gradients land and (overlap) its all-reduce starts.
            self._land_from_autograd()
            if self._armed:
                self._launch(0)

    def _hook(self, index: int, place: int, view: torch.Tensor) -> Callable[[torch.Tensor], None]:
        """The post-accumulate-grad hook of the parameter at `place` in bucket `index`
        (`view`): a closure over its place, as it runs in Python for every parameter in
        every backward pass; no_grad is entered only when grad mode is on (autograd runs a
        plain backward pass's hooks with it off)."""

        def gradient_ready(parameter: torch.Tensor) -> None:
            grad = parameter.grad
            if grad is None or not self._in_step:
                return
            written = self._written[index]
            with torch.no_grad() if torch.is_grad_enabled() else contextlib.nullcontext():
                if written[place]:
                    view.add_(grad, alpha=self._scale)
                else:
                    torch.mul(grad, self._scale, out=view)
                    written[place] = True
            parameter.grad = None
            if not self._armed:
                return
            pending = self._pending
            pending[index] -= 1
            # Buckets start in index order on every rank, so that collectives pair up.
            while self._launched < len(pending) and pending[self._launched] <= 0:
                self._launch(self._launched)

        return gradient_ready

    @torch.no_grad()
    def _land_from_autograd(self) -> None:
        """Unhooked: each parameter's accumulated gradient (None: unused this step, zeros)
        into its place, divided by the global batch; autograd's tensors are dropped."""
        for bucket in self._buckets:
            grads = [parameter.grad for parameter in bucket.params]
            if all(grad is not None for grad in grads):
                torch.cat([grad.reshape(-1) for grad in grads if grad is not None], out=bucket.flat)
                bucket.flat.mul_(self._scale)
            else:
                for view, grad in zip(bucket.views, grads, strict=True):
                    if grad is None:
                        view.zero_()
                    else:
                        torch.mul(grad, self._scale, out=view)
            for parameter in bucket.params:
                parameter.grad = None
        self._landed = True

    def _launch(self, index: int) -> None:
        self._launched = index + 1
        bucket = self._buckets[index]
        if self._hooked:
            # A parameter without a gradient this step (unused by the model's forward) adds zero.
            for view, written in zip(bucket.views, self._written[index], strict=True):
                if not written:
                    view.zero_()
        if self._group is None:
            return
        try:
            self._works.append(self._group.allreduce([bucket.flat]))
        except RuntimeError as error:
            # Seen by finish(): the backward pass is not the place to break the world.
            self._error = self._error or error

    def finish(self) -> None:
        self._armed = False
        if not self._hooked and not self._landed:
            # No backward pass ended the step (an empty share), or after_backward was not called.
            self._land_from_autograd()
        self._in_step = False
        while self._launched < len(self._buckets):
            self._launch(self._launched)
        if self._error is not None:
            raise RuntimeError(f"a gradient bucket's all-reduce failed to start: {self._error}")
        for work in self._works:
            self.wait_work(work)
        self._release()
        for bucket in self._buckets:
            for parameter, view in zip(bucket.params, bucket.views, strict=True):
                parameter.grad = view

    def _release(self) -> None:
        # A gloo group closes its connections only when its last reference goes (abort and
        # shutdown leave them open): holding it past the step would keep peers that wait on
        # this rank from seeing it leave a broken world.
        self._works = []
        self._group = None

    def abandon(self) -> None:
        self._armed = False
        self._in_step = False
        self._release()
        for bucket in self._buckets:
            for parameter in bucket.params:
                parameter.grad = None


def _device_type() -> str:
    return "cuda" if torch.cuda.is_available() and dist.is_nccl_available() else "cpu"


def live_shard_place(env: Mapping[str, str]) -> tuple[int, int] | None:
    """Under a Tidal launcher in live mode, this worker's (shard rank, shard size) in its
    replica: a replica of K nodes (`TIDAL_NODES_PER_REPLICA`) of P workers each
    (`LOCAL_WORLD_SIZE`) has K × P shard ranks, and this worker's is its node's place in the
    replica (`TIDAL_NODE_INDEX`) × P + `LOCAL_RANK`, its own for life. None outside live
    mode."""
    if env.get("TIDAL_MODE") != "live" or not env.get("TIDAL_CONTROL_SOCKET"):
        return None
    local_rank = int(env.get("LOCAL_RANK", "0"))
    local_size = int(env.get("LOCAL_WORLD_SIZE", "1"))
    nodes = int(env.get("TIDAL_NODES_PER_REPLICA") or 1)
    node_index = int(env.get("TIDAL_NODE_INDEX") or 0)
    if not (0 <= node_index < nodes and 0 <= local_rank < local_size):
        raise ValueError(f"node {node_index} of a replica of {nodes} nodes, local rank {local_rank} of {local_size} "
                         "(TIDAL_NODE_INDEX, TIDAL_NODES_PER_REPLICA, LOCAL_RANK, LOCAL_WORLD_SIZE): not a place "
                         "in a replica")
    return node_index * local_size + local_rank, nodes * local_size


def init_unit_group(backend: str | None = None) -> tuple[int, int, ShardGroup | None]:
    """Make torch.distributed's default group the replica's shard group, unless the script
    made one already. Returns (shard rank, shard size, the swappable group or None).

    Under a Tidal launcher in live mode it is a `ShardGroup` that each generation connects
    anew (a replica's nodes may change: a lost node's shard ranks are taken by a new
    process); in a fixed world (alone, torchrun, restart mode) a plain group of each node's
    workers at the world's store (GROUP_RANK), for the process's life."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), None
    env = os.environ
    backend = backend or ("nccl" if _device_type() == "cuda" else "gloo")
    local_rank = int(env.get("LOCAL_RANK", "0"))
    # This worker's GPU (LOCAL_RANK's) is current before the group and FSDP2's mesh use it.
    select_device(worker_device(env, backend))
    live = live_shard_place(env)
    if live is not None:
        rank, size = live
        return rank, size, install_shard_group(rank, size)
    local_size = int(env.get("LOCAL_WORLD_SIZE", "1"))
    timeout = datetime.timedelta(seconds=float(env.get("TIDAL_UNIT_TIMEOUT_S", "600")))
    group_rank = int(env.get("GROUP_RANK", str(int(env.get("RANK", "0")) // max(1, local_size))))
    store = dist.PrefixStore(f"tidal/unit/{group_rank}", fixed_world_store())
    dist.init_process_group(backend, store=store, rank=local_rank, world_size=local_size, timeout=timeout)
    return local_rank, local_size, None


class HybridSharded(Strategy):
    """FSDP2 over the workers of a unit, replicated across units (HSDP). Shard the model
    with `shard` before making the optimizer:

        strategy = HybridSharded()
        model = strategy.shard(model, modules=model.blocks)   # each block, then the root
        optimizer = torch.optim.AdamW(model.parameters())
        job = Elastic(model, optimizer, dataset, strategy=strategy, ...)
    """

    stops_within_step = False
    uniform_micro_batches = True
    vote_after_reduction = True

    def __init__(self, reshard_after_forward: bool = True, param_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None) -> None:
        self.reshard_after_forward = reshard_after_forward
        # Mixed precision (FSDP2's policy): compute in `param_dtype` (say bfloat16) while
        # the sharded master weights and the optimizer stay in theirs; gradients are
        # reduced in `reduce_dtype` (float32 when param_dtype is set and it is not).
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype if reduce_dtype is not None or param_dtype is None else torch.float32
        self._root: Any = None
        self._params: list[torch.nn.Parameter] = []
        self._group: Any = None
        self._works: list[Any] = []
        self._error: BaseException | None = None
        self._shard_rank = 0
        self._shard_size = 1
        self._shard_group: ShardGroup | None = None
        self._batch = 1

    @property
    def shard_size(self) -> int:
        return self._shard_size

    @property
    def shard_rank(self) -> int:
        return self._shard_rank

    @property
    def shard_group(self) -> ShardGroup | None:
        return self._shard_group

    def shard(self, model: ModuleT, modules: Iterable[torch.nn.Module] | None = None,
              backend: str | None = None) -> ModuleT:
        """Form the unit's shard group, then `fully_shard` each of `modules` (say, the
        transformer blocks) and the model itself over it. Returns the model (FSDP2 shards in
        place)."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self._shard_rank, self._shard_size, self._shard_group = init_unit_group(backend)
        device_type = "cuda" if (backend or _device_type()) == "nccl" else "cpu"
        mesh = init_device_mesh(device_type, (self._shard_size,), mesh_dim_names=("shard",))
        policy = MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)
        for module in modules or ():
            fully_shard(module, mesh=mesh, reshard_after_forward=self.reshard_after_forward, mp_policy=policy)
        fully_shard(model, mesh=mesh, reshard_after_forward=self.reshard_after_forward, mp_policy=policy)
        self._root = model
        return model

    def attach(self, model: torch.nn.Module, params: list[torch.nn.Parameter]) -> None:
        from torch.distributed.fsdp import FSDPModule

        if self._root is not model or not isinstance(model, FSDPModule):
            raise ValueError("HybridSharded: shard the model with strategy.shard(model, ...) before making the "
                             "optimizer, and give Elastic that model")
        self._params = params
        for module in list(self._root.modules()):
            if isinstance(module, FSDPModule):
                # Sums, not means, within the unit; Tidal divides by the global batch.
                module.set_gradient_divide_factor(1.0)
                # As plain SUMs: for float32 and bfloat16 FSDP2 would otherwise reduce with
                # PREMUL_SUM(1/factor), which gloo does not have.
                force_sum = getattr(module, "set_force_sum_reduction_for_comms", None)
                if force_sum is not None:
                    force_sum(True)
                module.set_all_reduce_hook(self._reduce_across_replicas)

    def _reduce_across_replicas(self, shard: torch.Tensor) -> None:
        if self._group is None:
            return
        try:
            self._works.append(self._group.allreduce([shard]))
        except RuntimeError as error:
            self._error = self._error or error

    def begin_step(self, group: Any, batch: int) -> None:
        if batch <= 0:
            raise ValueError(f"a step's global batch must be positive, not {batch}")
        self._group = group
        self._batch = batch
        self._works = []
        self._error = None
        for parameter in self._params:
            parameter.grad = None

    def before_backward(self, last: bool) -> None:
        # Between micro-batches FSDP2 accumulates unsharded gradients; the last one reduces.
        self._root.set_requires_gradient_sync(last)

    @torch.no_grad()
    def finish(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"a cross-replica all-reduce failed to start: {self._error}")
        for work in self._works:
            self.wait_work(work)
        self._works = []
        self._group = None
        for parameter in self._params:
            if parameter.grad is not None:
                local(parameter.grad).div_(self._batch)

    def abandon(self) -> None:
        self._works = []
        self._group = None
        self._drop_fsdp_step_state()
        for parameter in self._params:
            parameter.grad = None

    def _drop_fsdp_step_state(self) -> None:
        """A step cut short mid-pass (a peer of the replica lost) leaves FSDP2 holding part
        of it: between micro-batches it accumulates each parameter's unsharded gradient in
        the unsharded parameter's `.grad` (or `unsharded_accumulated_grad` with a reduce
        dtype), which the next step's backward would add to; and parameters may be left
        unsharded. Both go: the gradients here (torch 2.13's `reset_iter_state` does not
        clear them), then `reset_iter_state` reshards and clears FSDP2's per-step state."""
        from torch.distributed.fsdp import FSDPModule

        if self._root is None:
            return
        for module in self._root.modules():
            if not isinstance(module, FSDPModule):
                continue
            state = module._get_fsdp_state()
            for group in getattr(state, "_fsdp_param_groups", ()):
                for fsdp_param in group.fsdp_params:
                    fsdp_param.unsharded_accumulated_grad = None
                    unsharded = getattr(fsdp_param, "_unsharded_param", None)
                    if unsharded is not None:
                        unsharded.grad = None
        # A collective of the broken connection it waits on may fail: nothing to keep.
        with contextlib.suppress(AttributeError, RuntimeError):
            self._root.reset_iter_state()
