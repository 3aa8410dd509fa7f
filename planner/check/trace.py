"""Trace one rank of a plan on a fake world: the runtime's own `parallelize` and training step (the functions every
emitted script inlines), on torch's fake process group of the plan's world size, with fake tensors.

How (torch 2.13, shared/FINDINGS.md "Large-scale behaviour without a GPU"):

- ``init_process_group("fake", store=FakeStore(), rank=r, world_size=W)`` and the plan's (pp, dp, tp) mesh (with
  expert parallelism the runtime's (pp, edp, ep, tp) mesh, dp flattened: `planner.emit.runtime.expert_mesh`), built
  outside any fake mode (mesh coordinates need real tensors). Collectives are named by the group they run on:
  ``tp``, ``dp``, ``pp``, ``edp`` (the experts' gradient group), ``world``; an all-to-all on the ep group is
  ``all_to_all@ep`` even where that group is the whole dp group (ep = dp). On fake tensors the MoE routing takes its
  balanced case and the expert-parallel dispatch its balanced split sizes (`profiler.zoo.moe`,
  `planner.emit.runtime.expert_parallel_forward`): every rank sends and receives tokens·top_k/ep rows per layer;
- the model is built on the meta device and `planner.emit.runtime.parallelize` runs as it does in a script with
  ``init="meta"``: each rank allocates only its shards (``to_empty``). Only the weight initialisation is skipped
  (values do not change shapes, memory or collectives; allocated pages are never touched, so a 70B shard costs
  address space, not memory);
- under ``FakeTensorMode`` the optimizer takes one step on zero gradients (so its state exists, as in every step
  after the first), then one training step (`planner.emit.train.train_step_loss`, the step `train_step` wraps)
  runs under torch's ``MemTracker`` (memory by category, each at its maximum) and a dispatch mode that records every
  collective (kind, group, bytes) and counts FLOPs with ``FlopCounterMode``'s formulas on each op's local tensors
  (a DTensor op's shards; attention by `sdpa_flop_count`, which the CPU kernel lacks). One step, not
  two: DDP rebuilds its buckets before the second, which needs real tensors.

Precision: the CPU path of the runtime trains in fp32 (autocast and FSDP's mixed-precision policy apply on GPUs
only). A plan the runtime trains under autocast (16-bit outside FSDP) is traced under CPU autocast, which the
harness enters where a GPU would enter CUDA's (`_gpu_autocast`); an FSDP plan is traced, and compared, at fp32.

Two things a fake group cannot carry are supplied by the harness, each the same as what torch would have computed:
pipeline stages get their boundary shapes from the model's own forward on the meta device instead of torch 2.13's
vote and metadata exchange (`_static_stages`), and DDP's built-in all-reduce becomes the same reduction as a Python
hook (`_python_allreduce_hooks`). Under zero-bubble a stage's received activations reach its module as views of the
receive buffers (`_as_views`), so that torch's memory tracker can follow its ``autograd.grad`` input-gradient pass.

Three things of the tracker's own are set right: a real parameter's fake copy counts as the parameter
(`_CategoryPeaks._track`), the tracker's module hooks hold no autograd nodes (`_module_hooks_any`), and Python's
cycle collector does not run during the step (`_no_cycle_collection`). The tracker also keeps the highest memory of
every place of the step (micro-batch or schedule action, and block), which `planner.check.fold` extrapolates.
"""

from __future__ import annotations

import contextlib
import io
import re
from collections import defaultdict

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from costmodel.runnable import trains_under_autocast
from planner.check.fold import micro_batches_traced
from planner.check.record import Trace, memory_parts
from planner.emit import runtime, train
from planner.emit.config import runtime_config
from planner.emit.script import vocab_size
from planner.plan import Plan
from profiler.zoo.hf import grouped_mm_on_fake_fp32, masks_as_trained
from profiler.zoo.registry import resolve_model

#: collective ops (c10d and functional) → the kind they are, and which tensor argument carries the bytes moved
_KINDS = {
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce", "all_reduce_coalesced": "all_reduce", "all_reduce_coalesced_": "all_reduce",
    "_allgather_base_": "all_gather", "allgather_": "all_gather", "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter", "broadcast_": "broadcast", "send": "send",
    "recv_": "recv", "recv_any_source_": "recv", "alltoall_": "all_to_all", "alltoall_base_": "all_to_all",
    "all_to_all_single": "all_to_all",
}


class _Collectives(TorchDispatchMode):
    """Records every collective: kind, the group it runs on (named by mesh dimension where it is one), bytes."""

    def __init__(self, groups: dict[tuple, str], ep_ranks: tuple | None = None):
        super().__init__()
        self.groups = groups
        self.ep_ranks = ep_ranks  #: the ep group (all-to-alls on it are named ``ep``), None without ep
        self.log: list[tuple[str, str, int, int]] = []  # (kind, group, bytes, elements)
        self.flops = 0.0  #: torch's FLOP formulas (FlopCounterMode's registry) on this rank's local tensors
        self.dtensor_depth = 0  #: > 0 while a DTensor op runs: its collectives reach `record_inner`, not this mode

    def record_inner(self, kind: str, group, tensor: torch.Tensor) -> None:
        """A collective a DTensor op issues from inside its dispatch (a redistribution its sharding rule needs,
        ``loss_parallel``'s statistics), where this mode is not on the stack: seen through the functional
        collectives it calls (`_inner_collectives`)."""
        if not self.dtensor_depth:
            return  # issued outside DTensor dispatch: this mode records the op itself
        from torch.distributed._functional_collectives import _resolve_group_name
        from torch.distributed.distributed_c10d import _resolve_process_group

        ranks = tuple(dist.get_process_group_ranks(_resolve_process_group(_resolve_group_name(group))))
        scale = len(ranks) if kind == "all_gather" else 1  # the gathered buffer from this rank's shard
        nbytes = tensor.numel() * tensor.element_size() * scale
        self.log.append((kind, self.groups.get(ranks, f"{len(ranks)} ranks"), nbytes, tensor.numel() * scale))

    def record_relayout(self, group, tensor: torch.Tensor) -> None:
        """A copy torch's functional collectives make of ``tensor``'s bytes between a dim-1 layout and NCCL's dim 0
        around a collective on ``group`` (`_inner_collectives`), logged as ``relayout`` on that group."""
        from torch.distributed._functional_collectives import _resolve_group_name
        from torch.distributed.distributed_c10d import _resolve_process_group

        ranks = tuple(dist.get_process_group_ranks(_resolve_process_group(_resolve_group_name(group))))
        self.log.append(("relayout", self.groups.get(ranks, f"{len(ranks)} ranks"),
                         tensor.numel() * tensor.element_size(), 0))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns, name = func.namespace, func._opname
        if ns in ("c10d", "_c10d_functional") and name in _KINDS:
            self._record(_KINDS[name], args)
        inside = any(isinstance(a, DTensor) for a in args)  # DTensor runs the op (and its collectives) unseen
        self.dtensor_depth += inside
        try:
            out = func(*args, **kwargs)
        finally:
            self.dtensor_depth -= inside
        if ns not in ("c10d", "_c10d_functional"):  # aten and custom ops with a registered FLOP formula
            # (transformers' grouped-GEMM fallback); a DTensor op computes on its local shards (unseen here)
            local = [a._local_tensor if isinstance(a, DTensor) else a for a in args]
            packet = func._overloadpacket
            if packet in flop_registry:
                res = out._local_tensor if isinstance(out, DTensor) else out
                self.flops += flop_registry[packet](*local, **kwargs, out_val=res)
            elif "scaled_dot_product" in name and "attention" in name:
                self._attention(name, local)
        return out

    def _record(self, kind: str, args) -> None:
        ranks = None
        tensors = []
        for a in args:
            if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()):
                ranks = tuple(dist.get_process_group_ranks(dist.ProcessGroup.unbox(a)))
            elif isinstance(a, str) and ranks is None:
                with contextlib.suppress(Exception):
                    from torch.distributed.distributed_c10d import _resolve_process_group

                    ranks = tuple(dist.get_process_group_ranks(_resolve_process_group(a)))
            elif isinstance(a, torch.Tensor):
                tensors.append(a)
            elif isinstance(a, (list, tuple)):
                flat = [t for x in a for t in (x if isinstance(x, (list, tuple)) else [x])]
                tensors.extend(t for t in flat if isinstance(t, torch.Tensor))
        if not tensors:
            return
        sizes = [t.numel() * t.element_size() for t in tensors]
        numels = [t.numel() for t in tensors]
        if kind == "all_gather":  # the gathered buffer: a functional all-gather takes only this rank's shard
            n = len(ranks) if ranks else 1
            nbytes, elems = max(max(sizes), min(sizes) * n), max(max(numels), min(numels) * n)
        elif kind == "reduce_scatter":  # the full input, which every form of the op takes
            nbytes, elems = max(sizes), max(numels)
        else:
            nbytes, elems = sum(sizes), sum(numels)
        group = self.groups.get(ranks, f"{len(ranks)} ranks" if ranks else "?")
        if kind == "all_to_all" and ranks is not None and ranks == self.ep_ranks:
            group = "ep"
        self.log.append((kind, group, nbytes, elems))

    def _attention(self, name: str, args) -> None:
        q, k, v = args[:3] if "backward" not in name else args[1:4]
        if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
            return
        if "backward" in name:
            self.flops += sdpa_backward_flop_count(q.shape, q.shape, k.shape, v.shape)
        else:
            self.flops += sdpa_flop_count(q.shape, k.shape, v.shape)


def _stays_gathered(module) -> bool:
    """Whether ``module`` is an FSDP2 unit that keeps its parameters gathered after its forward (torch 2.13: its
    parameter group has no post-forward mesh, ``reshard_after_forward=False``)."""
    state = getattr(module, "_get_fsdp_state", None)
    group = getattr(state(), "_fsdp_param_group", None) if state is not None else None
    return group is not None and getattr(group, "post_forward_mesh_info", True) is None


class _CategoryPeaks(MemTracker):
    """torch's MemTracker, also keeping each category's own maximum over the step (its "peak" snapshot holds the
    categories at the moment of the total's peak, when, say, gradients are not all allocated yet), and accepting
    one forward per micro-batch. Hooks three of the tracker's methods (torch 2.13: ``_update_peak_stats``, which no
    longer keeps per-module peaks, ``_pre_fw_hook`` and ``_post_fw_hook``)."""

    def __init__(self, container: str):
        super().__init__()
        self.container = container
        self._block = re.compile(rf"^(.*?){re.escape(container)}\.(\d+)$")
        self.mirrors: set[int] = set()  #: the fake mode's storages standing for real parameters and buffers
        self.params: list = []  #: the traced parts' parameters (`_update_and_maybe_create_winfos`)
        self.buckets: dict[int, list[torch.Tensor]] = {}  #: DDP bucket placeholders by size (`hold_buckets`)
        self.at_peak: dict[str, int] = {}  #: the categories at the moment of the peak
        self.peak_where = ""  #: the modules running then, and whether in backward
        self.action = ""  #: what the step is doing: which micro-batch, or which schedule action of which stage
        self.moments: dict[str, tuple[int, dict, dict]] = {}  #: "action: place" (`place`) → (its highest total,
        #: the categories then, each category's own maximum there)
        self._parents_seen: set = set()
        self._bw_seen = False
        self._action_seen = None
        self._moment = ""

    def _track(self, reftype, t: torch.Tensor) -> None:
        # a real parameter (a part DDP wraps holds real tensors) enters fake ops as the fake mode's copy of it: the
        # same memory, tracked once, as the parameter; DDP's gradients are views into its buckets (`hold_buckets`),
        # whether an op touches them (the step's zeroing, here) or a hook (`_update_and_maybe_create_winfos`)
        sts = get_untyped_storages(t)
        if (self.mirrors and any(id(st) in self.mirrors for st in sts)) or getattr(t, "_autopar_bucket_view", False):
            return
        if reftype is _MemRefType.OPT:  # an op inside the optimizer step: torch's tracker calls its output a state
            if all(self._WINFO.get(st) is not None for st in sts):
                return  # a tensor it updates in place (a parameter, a state): it stays what it is
            reftype = _MemRefType.TEMP  # a new one is the step's temporary (the states it keeps are relabelled
            # Optstate by the tracker's post-step hook, `_track_optimizer_states`)
        if self.buckets and self._mod_tracker.is_bw:  # a DDP bucket's fake copy stands in for its placeholder
            for st in sts:
                if self._WINFO.get(st) is None and self.buckets.get(st.nbytes()):
                    self.buckets[st.nbytes()].pop()
                    reftype = _MemRefType.GRAD  # (what the placeholder was)
        super()._track(reftype, t)

    def _update_and_maybe_create_winfos(self, t: torch.Tensor, reftype, update_existing: bool = False) -> set:
        if getattr(t, "_autopar_bucket_view", False):  # DDP's gradients: views into its buckets (`hold_buckets`)
            return set()
        if reftype is _MemRefType.GRAD and self.params and not any(p.grad is t for p in self.params):
            # torch's tracker hooks each parameter (``register_hook``) and calls the gradient arriving for it a
            # gradient before autograd accumulates it: a micro-batch's new gradient is a temporary until it is
            # ``.grad`` (the post-accumulate hook then relabels it), or is added into ``.grad`` and freed
            reftype = _MemRefType.TEMP
        return super()._update_and_maybe_create_winfos(t, reftype, update_existing)

    def hold_buckets(self, sizes: list[int]) -> None:
        """DDP's gradient buckets (its reducer allocates them, real, when it is built: a GPU holds them through every
        step) as fake placeholders of their sizes, counted as gradients from the step's start; the tracker sees the
        real buckets only as the fake copies the backward makes when it fills them, and each replaces a placeholder
        of its size then."""
        for size in sizes:
            t = torch.empty(size, dtype=torch.uint8)
            # (torch's own labelling: no parameter's .grad is the placeholder, which ours would call a temporary)
            MemTracker._update_and_maybe_create_winfos(self, t, _MemRefType.GRAD)
            self.buckets.setdefault(size, []).append(t)

    def _pre_fw_hook(self, module, inputs) -> None:
        # a module runs once per micro-batch; torch's tracker refuses a second forward of a module in one session
        # unless its per-module statistics are reset (only the per-category totals are used here)
        if not self._mod_tracker.is_bw:
            self.memory_tracking.pop(module, None)
        super()._pre_fw_hook(module, inputs)

    def _post_fw_hook(self, module, inputs, outputs) -> None:
        # FSDP2 all-gathers a unit's parameters in its own pre-forward hook, after the tracker's (global hooks run
        # first), so their unsharded storages are first seen as forward outputs (activations); where they stay
        # gathered past the forward (ZeRO-2: ``reshard_after_forward=False``, and every micro-batch but the last
        # keeps them into the next), the next micro-batch's pre-forward relabels them parameters, so only the
        # first micro-batch counted them as activations. Relabelled here, as soon as the forward is over (the
        # global post-forward hook also runs before FSDP's own; ZeRO-3's units, freed then, are left alone)
        if not self._mod_tracker.is_bw and _stays_gathered(module):
            for p in module.parameters():  # (as the tracker's pre-forward hook does)
                self._update_and_maybe_create_winfos(p, _MemRefType.PARAM)
        super()._post_fw_hook(module, inputs, outputs)

    def _update_peak_stats(self, peak_state) -> None:
        # called after every op: torch's version also walks every tracked module for per-module peaks (unused
        # here), which made a trace quadratic in the model's size; only the totals and categories are kept, and
        # each moment's own maximum (the phase and innermost module running: `planner.check.fold` extrapolates
        # them one by one)
        parents, bw = self._mod_tracker.parents, self._mod_tracker.is_bw
        if parents != self._parents_seen or bw != self._bw_seen or self.action is not self._action_seen:
            self._parents_seen, self._bw_seen, self._action_seen = set(parents), bw, self.action
            place = self.place(parents, bw)
            self._moment = f"{self.action}: {place}" if self.action else place
        moment = self._moment
        for dev, dev_snap in self._curr_mem_snap.items():
            if moment not in self.moments:
                self.moments[moment] = (-1, {}, defaultdict(int))
            total_max, _, place_max = self.moments[moment]
            for key, value in dev_snap.items():
                name = str(getattr(key, "value", key))
                if value > place_max[name]:
                    place_max[name] = value
            total = dev_snap.get("Total", 0)
            if total > total_max:
                self.moments[moment] = (total, {str(getattr(k, "value", k)): v for k, v in dev_snap.items()},
                                        place_max)
            if self._peak_mem.get(dev, 0) < total:
                self._peak_mem[dev] = total
                self.at_peak = self.moments[moment][1]
                inner = sorted((p for p in parents if p != "Global"), key=len)[-1:]
                self.peak_where = (f"{self.action}: " if self.action else "") + ("backward" if bw else "forward") + (
                    f" of {inner[0].replace('_checkpoint_wrapped_module.', '')}" if inner else "")

    @property
    def category_max(self) -> dict[str, int]:
        """Each category's maximum over the step (``Total``: the peak): the highest of every place's own."""
        out: dict[str, int] = defaultdict(int)
        for _, _, most in self.moments.values():
            for name, value in most.items():
                out[name] = max(out[name], value)
        return out

    def place(self, parents: set, bw: bool) -> str:
        """Where a step is, for `moments`: forward or backward, and the block running (the last one entered when
        two overlap: the lower-numbered one in backward; a module list's ``N``-th block is ``…container.N``), or
        the modules running outside the blocks."""
        phase = "backward" if bw else "forward"
        blocks = [(int(m.group(2)), m.group(1)) for p in parents if (m := self._block.search(p))]
        if blocks:
            i, prefix = min(blocks) if bw else max(blocks)
            return f"{phase} of {prefix}{self.container}.{i}"
        names = ", ".join(sorted(p for p in parents if p != "Global"))
        return f"{phase} of {names}" if names else phase


def _mesh_groups(mesh) -> dict[tuple, str]:
    """This rank's group of each mesh dimension (ranks tuple → dimension name), and the whole world. With context
    parallelism the gradients reduce over the flattened dp × cp group (`planner.emit.runtime.data_parallel_mesh`),
    which is named ``dp`` as the cost model names the gradient-reduction group; the batch's own dp dimension is
    ``dp rows``."""
    out = {}
    dims = mesh.mesh_dim_names or ()
    names = (("tp", "dp", "pp", "edp", "ep") if "ep" in dims else
             ("tp", "cp", ("dp_cp", "dp"), ("dp", "dp rows"), "pp") if "cp" in dims else ("tp", "dp", "pp"))
    for name in names:  # a 1-sized dimension's group is this rank alone
        dim, label = name if isinstance(name, tuple) else (name, name)
        # (the flattened group as the runtime takes it, `data_parallel_mesh`: slicing it off the root mesh is
        # deprecated in torch 2.13)
        sub = (mesh["dp", "cp"]._flatten("dp_cp") if dim == "dp_cp" else
               mesh["edp", "ep"]._flatten("dp") if dim == "dp" and "ep" in dims else mesh[dim])
        out.setdefault(tuple(dist.get_process_group_ranks(sub.get_group())), label)
    out.setdefault(tuple(range(dist.get_world_size())), "world")
    return out


@contextlib.contextmanager
def _shapes_only(fake: FakeTensorMode, rt=runtime):
    """Inside `planner.emit.runtime.materialize`, skip the model's weight initialisation (shapes only) and allocate
    the shards as fake tensors (no memory, no compute in the optimizer step: an in-place update of a real tensor
    under FakeTensorMode runs the real kernel) where every parameter and buffer of the part is a DTensor (FSDP or
    tensor parallel): ``to_empty`` swaps tensors, which torch refuses for a plain tensor that the fake mode's
    converter has seen. A part DDP wraps holds plain tensors (DDP runs with tp = 1 only), so it stays real, as its
    reducer needs."""
    if not hasattr(rt, "materialize"):  # a script specialised to a whole-model init has no meta path
        yield
        return
    saved_init, saved_materialize = rt.find_init, rt.materialize

    def materialize(part, *args, **kwargs):
        shards = all(isinstance(t, DTensor) for t in [*part.parameters(), *part.buffers()] if t.is_meta)
        with fake if shards else contextlib.nullcontext():
            return saved_materialize(part, *args, **kwargs)

    rt.find_init = lambda model: (lambda: None)
    rt.materialize = materialize
    try:
        yield
    finally:
        rt.find_init, rt.materialize = saved_init, saved_materialize


#: torch.distributed._functional_collectives functions DTensor calls from inside its dispatch → (kind, argument
#: index of the group). torch 2.13's base functions: DTensor's redistributions call ``all_gather_single`` and
#: ``reduce_scatter_single`` (``placement_types``, ``_collective_utils``), and the ``*_autograd`` variants and the
#: deprecated ``*_tensor`` names call these through the module, so each collective is recorded once
_FUNCOL = {"all_reduce": ("all_reduce", 2), "all_gather_single": ("all_gather", 2),
           "reduce_scatter_single": ("reduce_scatter", 3), "all_to_all_single": ("all_to_all", 3),
           "broadcast": ("broadcast", 2)}


@contextlib.contextmanager
def _inner_collectives(counter: _Collectives):
    """Route the functional collectives DTensor calls inside its own dispatch to ``counter.record_inner``, and the
    copies the functional collectives make around a collective along another dim than 0 to
    ``counter.record_relayout`` (inside DTensor's dispatch or not: this mode records no ``aten.cat``)."""
    import torch.distributed._functional_collectives as funcol

    saved = {name: getattr(funcol, name) for name in _FUNCOL}

    def wrap(name, original):
        kind, at = _FUNCOL[name]

        def call(tensor, *args, **kwargs):
            group = kwargs.get("group", args[at - 1] if len(args) >= at else None)
            counter.record_inner(kind, group, tensor)
            return original(tensor, *args, **kwargs)

        return call

    # the copies around collectives along a dim other than 0 (`costmodel.layercost.seq_relayout_bytes`): the group
    # of the all_gather_single or reduce_scatter_single running, and each copy its helpers make
    relayouts = {"all_gather_single": 2, "reduce_scatter_single": 3}  # (argument index of the group)
    helpers = ("_maybe_view_chunk_cat", "_chunk_or_narrow_cat")
    saved |= {name: getattr(funcol, name) for name in (*relayouts, *helpers)}
    running: list = []

    def around(name, original):
        def call(tensor, *args, **kwargs):
            at = relayouts[name]
            running.append(kwargs.get("group", args[at - 1] if len(args) >= at else None))
            try:
                return original(tensor, *args, **kwargs)
            finally:
                running.pop()

        return call

    def copying(original):
        def call(tensor, *args, **kwargs):
            out = original(tensor, *args, **kwargs)
            if running and running[-1] is not None and out is not tensor and not out._is_view():  # (a view or
                # the tensor itself moves nothing)
                counter.record_relayout(running[-1], out)
            return out

        return call

    for name, original in saved.items():
        if name in relayouts or name in _FUNCOL:  # (the gather and the scatter are both)
            call = around(name, original) if name in relayouts else original
            setattr(funcol, name, wrap(name, call) if name in _FUNCOL else call)
        else:
            setattr(funcol, name, copying(original))
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(funcol, name, original)


def trace_rank(plan: Plan, rank: int, *, source=None, micro_batches: int | None = None, code=None) -> Trace:
    """Run ``plan``'s runtime on a fake world as global rank ``rank`` and record its last step (see the module
    docstring). Leaves no process group behind.

    ``source``: the model to build instead of ``plan.model``'s (`planner.check.fold` passes a shallower one).
    ``micro_batches``: the step's real number of micro-batches when ``plan`` (pp = 1) runs fewer, at least
    `planner.check.fold.micro_batches_traced`: the first, one in the middle and the last (under ZeRO-3 the first
    and the last, which does what a middle one does). Every micro-batch in the middle of a step does the same thing
    (same shapes, same collectives, no gradient synchronisation), so the second one's collectives and FLOPs count
    as many more times as the step has micro-batches beyond those traced; memory is the step's (the middle ones
    repeat the same states).
    ``code``: an emitted script, loaded as a module (`planner.check.tracers.load_script`): its own ``PLAN``,
    ``build_model`` and runtime run instead of autopar's (as emitted, or as its user edited it). Its ``PLAN`` keeps
    its init: a model initialised whole is real on this machine (memory figures then count it twice: the check of
    a script says whether it starts and what it communicates).
    """
    rt, tr = (code, code) if code is not None else (runtime, train)
    source = source or resolve_model(plan.model).with_seq(plan.seq)
    fewest = micro_batches_traced(plan.config.zero)
    if micro_batches is not None and micro_batches != plan.grad_accum and (
            plan.config.pp > 1 or plan.grad_accum < fewest or micro_batches < plan.grad_accum):
        raise ValueError(f"cannot count {micro_batches} micro-batches from a trace of {plan.grad_accum} "
                         f"(pp={plan.config.pp}): trace pp = 1 plans with {fewest} or more")

    def build():  # what the emitted script's build_model() does; the runtime calls it under torch.device("meta")
        if source.family == "hf":  # (ModelSource.build(device="meta") would give fake tensors, for capture)
            from profiler.zoo import hf

            return hf.build_lm(source.config)
        model, _ = source.build(batch=plan.config.mbs, seq=plan.seq, device="meta")
        return model

    if code is not None:
        build, config = code.build_model, dict(code.PLAN)
    else:
        with torch.device("meta"):
            config = runtime_config(plan, build(), init="meta", optimizer="adamw")
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process; trace in a fresh one")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=config["world"])
    try:
        if hasattr(rt, "build_mesh"):  # the runtime's own mesh (a script emitted before it has none)
            mesh = rt.build_mesh(config, "cpu")
        elif config.get("ep", 1) > 1:
            mesh = rt.expert_mesh(config, "cpu")
        else:
            mesh = init_device_mesh("cpu", (config["pp"], config["dp"], config["tp"]),
                                    mesh_dim_names=("pp", "dp", "tp"))
        coords = {name: (rt.batch_mesh(config, mesh) if name == "dp" and hasattr(rt, "batch_mesh") else
                         mesh[name]).get_local_rank() for name in ("pp", "dp", "tp")}
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        # (the runtime's notes are about a run on this machine, "this CPU run trains in fp32", not about this trace)
        with (_shapes_only(fake, rt), contextlib.redirect_stdout(io.StringIO()),
              _rebuilt_buckets() if config["grad_compress"].startswith("powersgd") else contextlib.nullcontext()):
            par = rt.parallelize(build, config, mesh)
        if config["grad_compress"] == "none":
            _python_allreduce_hooks(par)
        powersgd = _powersgd_steady(par)
        if config["pp"] > 1:
            with masks_as_trained(), grouped_mm_on_fake_fp32():  # (a stage's fake forward: an fp32 plan's experts)
                _static_stages(par, config, build)
        optimizer = tr.build_optimizer(par, config)
        vocab = source.vocab if getattr(source, "vocab", None) else _vocab(source, plan.seq)
        inputs, labels = tr.synthetic_batch(0, batch=plan.global_batch, seq=plan.seq, vocab=vocab, seed=0)
        # this rank's rows, as a script's data loader gives them (the global batch is never on a GPU)
        inputs, labels = inputs[tr.data_rows(par)].clone(), labels[tr.data_rows(par)].clone()
        ep_ranks = tuple(dist.get_process_group_ranks(mesh["ep"].get_group())) if config.get("ep", 1) > 1 else None
        counter = _Collectives(_mesh_groups(mesh), ep_ranks)
        in_place = getattr(tr, "zeroes_grads_in_place", train.zeroes_grads_in_place)(par)  # (an older script's: ours)
        with fake:  # the optimizer state a steady-state step holds (AdamW creates it at its first step)
            _create_optimizer_state(par, optimizer, in_place)
        tracker = _CategoryPeaks(config["block_container"])
        tracker.params = [p for m in par.modules for p in m.parameters()]
        # (a DTensor's local shard is real too where the part is not all DTensors: tensor parallelism without
        # sequence parallelism leaves the norms plain, `_shapes_only`)
        real = [t for m in par.modules for t in map(_local, [*m.parameters(), *m.buffers()])
                if not isinstance(t, FakeTensor) and not t.is_meta]
        mirrors = [fake.from_tensor(t) for t in real]  # (the converter keeps them: ops get these same copies)
        tracker.mirrors = {id(st) for t in mirrors for st in get_untyped_storages(t)}
        tracker.track_external(*par.modules, getattr(optimizer, "optim", optimizer))  # ZeRO-1: its local optim
        with (_no_cycle_collection(), _propagation_off_the_books(), _module_hooks_any(), fake, tracker, counter,
              _inner_collectives(counter), _valued_futures() if powersgd else contextlib.nullcontext(),
              grouped_mm_on_fake_fp32(), masks_as_trained(), _step_actions(par, tracker, counter, tr) as marks):
            tracker.hold_buckets(_ddp_bucket_sizes(par))
            # (what keeps the propagator's tensors out: the tracker counts ops under the mode it was entered under)
            assert getattr(tracker, "_fake_mode_on_entry", fake) is fake, "MemTracker entered outside the check's mode"
            with _gpu_autocast(tr):
                tr.train_step_loss(par, optimizer, inputs, labels)
        if micro_batches is not None and micro_batches > plan.grad_accum:
            _repeat_middle(counter, marks, micro_batches - plan.grad_accum)
        memory = memory_parts(tracker.category_max.__getitem__)
        moments = {k: (total, cats, dict(most)) for k, (total, cats, most) in tracker.moments.items()}
        at_peak = dict(tracker.at_peak)
        if micro_batches is not None and micro_batches > plan.grad_accum:
            # the step's rows of the micro-batches not traced, held (as activations) through the whole step
            rows = (inputs.nbytes + labels.nbytes) * (micro_batches - plan.grad_accum) // plan.grad_accum
            memory["activations"] += rows
            memory["peak"] += rows

            def held(cats: dict) -> dict:
                return cats | {"Activation": cats.get("Activation", 0) + rows, "Total": cats.get("Total", 0) + rows}

            moments = {_real_micro_batch(k, plan.grad_accum, micro_batches): (total + rows, held(cats), held(most))
                       for k, (total, cats, most) in moments.items()}
            at_peak = held(at_peak)
            tracker.peak_where = _real_micro_batch(tracker.peak_where, plan.grad_accum, micro_batches)
        collectives: dict = defaultdict(lambda: {"count": 0, "bytes": 0})
        reduced = 0.0
        for kind, group, nbytes, elems in counter.log:
            entry = collectives[f"{kind}@{group}"]
            entry["count"] += 1
            entry["bytes"] += nbytes
            if group in ("dp", "edp") and kind in ("all_reduce", "reduce_scatter"):  # (edp: the experts')
                reduced += elems
        # where ep = dp each expert is on one rank of the dp group: nothing of it to reduce
        alone = {id(p) for part in par.parts for m in rt.expert_modules(part) for p in m.parameters()} \
            if config.get("ep", 1) == config["dp"] > 1 else set()
        grad_elems = sum(_local(p).numel() for m in par.modules for p in m.parameters()
                         if p.requires_grad and id(p) not in alone)
        return Trace(rank=rank, coords=coords, memory=memory, collectives=dict(collectives),
                     flops=float(counter.flops),
                     grad_elements=float(grad_elems) if config["dp"] > 1 else 0.0, dp_reduced_elements=reduced,
                     memory_at_peak=at_peak, peak_at=tracker.peak_where,
                     moments=moments)
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _gpu_autocast(tr):
    """The autocast a GPU runs the step under, on the CPU: the runtime's CPU path trains without it, so while
    inside, the step's own ``autocast`` (`planner.emit.train.autocast`, or an emitted script's) enters CPU autocast
    where a GPU would enter CUDA's, over the same region (the forward and backward passes, not the gradient
    reductions after them, the clipping or the optimizer step). The check's capture replays the same CPU policy
    (`planner.check.tracers.check_capture`)."""
    original = tr.autocast

    def on_cpu(plan: dict, device):
        if trains_under_autocast(plan["precision"], plan["zero"], plan["dp"] * plan.get("cp", 1)):
            return torch.autocast("cpu", dtype=runtime.DTYPES[plan["precision"]])
        return original(plan, device)

    tr.autocast = on_cpu
    try:
        yield
    finally:
        tr.autocast = original


@contextlib.contextmanager
def _module_hooks_any():
    """The memory tracker's module tracker (torch 2.13 ``ModTracker._fw_pre_hook``) learns that a module's backward
    is over from a multi-grad hook on its inputs in "all" mode, whose closure holds the inputs' autograd nodes while
    the nodes hold the hook: a cycle through C++ that Python's collector cannot see. A full backward frees each
    node's saved tensors as it runs; zero-bubble's input pass (``autograd.grad(..., retain_graph=True)``) and weight
    pass leave nodes that neither traverses, whose saved tensors the cycle then keeps for ever: traced, every
    micro-batch's activations outlived the step (untraced, with real tensors, none do). In "any" mode the hook holds
    no nodes; it fires at the first of the inputs' gradients instead of the last, which only matters for a module
    with several inputs that need gradients (none here: a block's rotary tables do not)."""
    import functools

    from torch.distributed._tools import mod_tracker

    saved = mod_tracker.register_multi_grad_hook
    mod_tracker.register_multi_grad_hook = functools.partial(saved, mode="any")
    try:
        yield
    finally:
        mod_tracker.register_multi_grad_hook = saved


@contextlib.contextmanager
def _propagation_off_the_books():
    """DTensor's sharding propagator derives every op's global output shape by running the op on fake tensors of
    the *global* shapes (torch 2.13, ``ShardingPropagator._propagate_tensor_meta_non_cached``: "call the tracing in
    fake tensor mode so that it avoids materializing memory"), in ``detect_fake_mode() or FakeTensorMode()``. On a
    GPU no fake mode is active, so it takes a fresh one: no device memory. Under the check it found the check's own
    fake mode, and torch's MemTracker counts an op exactly when the active fake mode is the one it was entered under
    (``mem_tracker.py``, ``_fake_mode_on_entry``): it counted those global tensors. Every tensor-parallel op's trace
    was inflated (a column-parallel matmul and its backward at tp = 4: 5.5 local output slices against 3.5), and
    ``loss_parallel``'s backward, which propagates the whole vocabulary's logits, traced 6 and 10 local slices at
    tp = 2 and 4 where its real working set, run on the local slices only (``_nll_loss_and_log_softmax_backward``),
    is 5 at any tp (a MemTracker on a fake process group, 4096 tokens × 32000 vocab, 2026-12-04). Here the
    propagator gets a fake mode of its own, as on a GPU, which MemTracker's filter then leaves out (a private
    heuristic of torch's: the traced step asserts the tracker was entered under the check's mode)."""
    from torch.distributed.tensor import _sharding_prop

    own = FakeTensorMode()
    found = _sharding_prop.detect_fake_mode
    _sharding_prop.detect_fake_mode = lambda *args, **kwargs: own
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = found


@contextlib.contextmanager
def _no_cycle_collection():
    """Python's cyclic garbage collector off during the traced step. Tensors that only a reference cycle keeps are
    freed when the collector next runs, which its allocation counts decide: with it on, the same step traced at two
    depths differed by such tensors (zero-bubble, before `_module_hooks_any`). Off, a trace is deterministic and holds
    what a step holds when the collector does not run in it (the most it can hold)."""
    import gc

    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@contextlib.contextmanager
def _step_actions(par, tracker: _CategoryPeaks, counter: _Collectives, tr=train):
    """Name what the step is doing on ``tracker.action`` (`_CategoryPeaks.moments` keeps a maximum per action and
    place): with pp = 1 the micro-batch (`planner.emit.train._accumulate` calls), with a pipeline the schedule's
    actions (torch 2.13 ``PipelineStage.forward_one_chunk``, ``backward_one_chunk``, ``backward_weight_one_chunk``:
    F, B and W, with the micro-batch and the stage). Yields where each micro-batch starts and ends in ``counter``'s
    log and FLOPs: (log index, FLOPs) pairs, two per micro-batch (pp = 1)."""
    marks: list[tuple[int, float]] = []
    original = getattr(tr, "_accumulate", None)  # (a script with a pipeline has none)
    patched: list[tuple[object, str]] = []

    def accumulate(*args, **kwargs):
        tracker.action = f"micro-batch {len(marks) // 2}"
        marks.append((len(counter.log), counter.flops))
        try:
            return original(*args, **kwargs)
        finally:
            marks.append((len(counter.log), counter.flops))
            tracker.action = f"after micro-batch {len(marks) // 2 - 1}"

    def named(stage, method: str, letter: str):
        call = getattr(stage, method)

        def action(chunk, *args, **kwargs):
            tracker.action = f"{letter}{chunk} of stage {stage.stage_index}"
            try:
                return call(chunk, *args, **kwargs)
            finally:
                tracker.action = f"after {letter}{chunk} of stage {stage.stage_index}"

        return action

    if original is not None:
        tr._accumulate = accumulate
    for stage in getattr(par, "stages", None) or []:
        for method, letter in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"),
                               ("backward_weight_one_chunk", "W")):
            setattr(stage, method, named(stage, method, letter))
            patched.append((stage, method))
    try:
        yield marks
    finally:
        if original is not None:
            tr._accumulate = original
        for stage, method in patched:
            delattr(stage, method)  # the class's method again


def _real_micro_batch(place: str, traced: int, real: int) -> str:
    """A place in a step of ``traced`` micro-batches named in the step of ``real`` it stands for: the last is the
    last, the middle one every one in the middle (with two traced, the last stands for those too)."""
    def name(match):
        i = int(match.group(1))
        return f"micro-batch {real - 1}" if i == traced - 1 else f"micro-batch {i}" if i == 0 else (
            f"micro-batches 1-{real - 2}")

    return re.sub(r"micro-batch (\d+)", name, place)


def _repeat_middle(counter: _Collectives, marks: list[tuple[int, float]], times: int) -> None:
    """Count the second micro-batch's collectives and FLOPs ``times`` more times (see `trace_rank`): one in the
    middle, or under ZeRO-3 the last (`planner.check.fold.micro_batches_traced`)."""
    (start, f0), (end, f1) = marks[2], marks[3]
    counter.log.extend(counter.log[start:end] * times)
    counter.flops += (f1 - f0) * times


def _static_stages(par, config: dict, build) -> None:
    """Give every local pipeline stage the shapes of what it receives and sends, read off one forward of the whole
    model on the meta device (a stage starts at its first block's input; the first takes the tokens, the last
    returns the model's output; bf16 on the wire with ``pp_compress``), and let torch's schedule take them as
    static metadata: its warm-up vote (``_warmup_forward_vote``/``_warmup_backward_result``, torch 2.13) answers
    "static" without the group. A real run would infer the same shapes through the group (DYNAMIC mode)."""
    from torch.distributed.pipelining._utils import _StageMeta, extract_tensor_metas

    with torch.device("meta"):  # (as the runtime builds it: no weights)
        model = build()
    container = config["block_container"]
    blocks = model.get_submodule(container)
    first = {}  # stage -> index of its first block
    for i in range(len(blocks)):
        first.setdefault(config["stage_of"][f"{container}.{i}"], i)
    seen: dict[int, torch.Tensor] = {}  # a stage's first block's input; the last block's output (a stage holding
    # no block, only the final norm and head, receives that)

    def keep(i):
        def hook(module, args):
            seen.setdefault(i, args[0])  # (returns None: the block's arguments stay as they are)
        return hook

    def last(module, args, out):
        seen.setdefault(len(blocks), out[0] if isinstance(out, tuple) else out)

    hooks = [blocks[i].register_forward_pre_hook(keep(i)) for i in first.values()]
    hooks.append(blocks[len(blocks) - 1].register_forward_hook(last))
    tokens = torch.zeros(config["mbs"], config["seq"], dtype=torch.long, device="meta")
    if callable(getattr(model, "pipeline_stage", None)):  # a Hugging Face model: its mask utilities call .item(),
        # which meta tensors cannot answer; fake ones (fresh parameters, gradients required as the model's) can
        from torch.func import functional_call

        with FakeTensorMode(allow_non_fake_inputs=True):
            state = {n: torch.empty(t.shape, dtype=t.dtype).requires_grad_(t.requires_grad)
                     for n, t in [*model.named_parameters(), *model.named_buffers()]}
            tokens = torch.zeros(config["mbs"], config["seq"], dtype=torch.long)
            output = functional_call(model, state, (tokens,))
    else:
        output = model(tokens)  # with autograd on: what needs a gradient sent back says so (requires_grad)
    for h in hooks:
        h.remove()
    n_stages = config["pp"] * config["vpp"]
    wire = torch.bfloat16 if config["pp_compress"] == "bf16" else None

    def boundary(s: int) -> torch.Tensor:  # what stage s receives (its tensor-parallel slice: apply_pp_scatter)
        if s == 0:
            return tokens
        t = seen[first.get(s, len(blocks))]  # (a stage after every block's: the last one's output)
        # contiguous, as the runtime's `_hidden_slice` sends it (a copy): torch builds each receive buffer with
        # ``empty_strided`` on the metadata's strides (pipelining/_utils.py, _make_tensor_from_meta), so a view's
        # strides would allocate tp times the slice for every buffer of the step
        t = t[..., : t.shape[-1] // config["tp"]].contiguous()
        return t.to(wire) if wire is not None else t

    for stage in par.stages:
        s = stage.stage_index
        sent = output if s == n_stages - 1 else boundary(s + 1)
        stage._user_meta = _StageMeta(inputs=extract_tensor_metas((boundary(s),)),
                                      outputs=extract_tensor_metas((sent,)))
        # a tensor made inside FakeTensorMode from a literal keeps its value, so the schedule's .item() works
        stage._warmup_forward_vote = lambda has_backward, received_acc=None: torch.tensor([1], dtype=torch.int32)
        stage._warmup_backward_result = lambda received_result=None: torch.tensor([1], dtype=torch.int32)
        if config["schedule"] == "zb":  # (the other schedules read the inputs' .grad, which a view lacks)
            stage._retrieve_recv_activations = _as_views(stage._retrieve_recv_activations)


def _as_views(retrieve):
    """A stage's received activations as views of the receive buffers (no copy): torch's MemTracker hooks the
    stage module's inputs with a multi-grad hook, which autograd.grad() (the zero-bubble schedule's input
    gradients, which it returns rather than reading ``.grad``) refuses on a leaf tensor; a view is not a leaf, and
    its gradient is the buffer's. The views live as long as the buffers: torch's input pass leaves its gradient in
    the buffer's ``.grad`` (``stage_backward_input``) until the next step, and here in the view's."""
    kept = []

    def call(*args, **kwargs):
        received = tuple(t.view_as(t) if isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad else t
                         for t in retrieve(*args, **kwargs))
        kept.append(received)
        return received

    return call


def _python_allreduce_hooks(par) -> None:
    """DDP's built-in all-reduce (no comm hook) reads its result from the work's future, which the fake group leaves
    empty (the C++ reducer then fails). Register the same reduction as a Python hook: all-reduce the bucket in place
    and divide by the group size, exactly what the built-in one does."""

    def hook(group, bucket):
        buffer = bucket.buffer()
        buffer.div_(group.size())
        fut = dist.all_reduce(buffer, group=group, async_op=True).get_future()
        return fut.then(lambda _: buffer)

    for module in par.modules:
        if isinstance(module, torch.nn.parallel.DistributedDataParallel):
            module.register_comm_hook(module.process_group, hook)  # the hook's state: DDP's own group


@contextlib.contextmanager
def _rebuilt_buckets():
    """DDP modules made here bucket their gradients as DDP does from its second step on, when PowerSGD compresses
    (`_powersgd_steady`): torch 2.13 puts every gradient in one bucket for the first step (no unused parameters:
    ``_BucketCapacityConfig.compute_bucket_size_limits``) and then rebuilds buckets of the first and the usual caps,
    in the order the gradients came; here those caps from the start, in the reverse order of the parameters (DDP's
    own guess of that order)."""
    from torch.nn.parallel.distributed import _BucketCapacityConfig

    original = _BucketCapacityConfig.compute_bucket_size_limits

    def rebuilt(self, *args, **kwargs):
        if self.has_custom_per_bucket_caps:
            return original(self, *args, **kwargs)
        return [self.first_bucket_bytes_cap, self.bucket_bytes_cap], []

    _BucketCapacityConfig.compute_bucket_size_limits = rebuilt
    try:
        yield
    finally:
        _BucketCapacityConfig.compute_bucket_size_limits = original


def _powersgd_steady(par) -> bool:
    """Put every DDP module's PowerSGD state at the step compression starts (``start_powerSGD_iter``): the traced
    step compresses its buckets (DDP's rebuilt ones, `_rebuilt_buckets`), as the cost model prices it
    (`costmodel.compression.powersgd_volume`), and is not one of the uncompressed warm-up steps. Its error-feedback
    buffers and low-rank factors are made in the traced backward, where they exist from the previous step in a
    real run: at the step's peak, after the backward, both are there. Whether there is one."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    found = False
    for module in par.modules:
        for _, state in getattr(module, "_comm_hooks", ()):
            if isinstance(state, PowerSGDState):
                state.iter = state.start_powerSGD_iter
                found = True
    return found


@contextlib.contextmanager
def _valued_futures():
    """torch's PowerSGD hook reads each all-reduce's result from its work's future (``fut.value()[0]``), which the
    fake process group leaves empty. An asynchronous ``dist.all_reduce`` here returns the work with a future that
    holds the tensor it reduced in place (the fake group moves no data: the tensor is the result)."""
    original = dist.all_reduce

    class Work:
        def __init__(self, work, tensor):
            self.work, self.tensor = work, tensor

        def wait(self, *args):
            return self.work.wait(*args)

        def get_future(self):
            fut = torch.futures.Future()
            fut.set_result([self.tensor])
            return fut

    def all_reduce(tensor, *args, **kwargs):
        work = original(tensor, *args, **kwargs)
        asynchronous = kwargs.get("async_op", args[2] if len(args) > 2 else False)
        return Work(work, tensor) if asynchronous else work

    dist.all_reduce = all_reduce
    try:
        yield
    finally:
        dist.all_reduce = original


def _ddp_bucket_sizes(par) -> list[int]:
    """The bytes of each gradient bucket of every DDP module of ``par``, as DDP's own logging data gives them."""
    sizes = []
    for module in par.modules:
        if isinstance(module, torch.nn.parallel.DistributedDataParallel):
            text = module._get_ddp_logging_data().get("bucket_sizes", "")
            sizes += [int(x) for x in str(text).split(",") if x.strip()]
    return sizes


def _create_optimizer_state(par, optimizer, in_place: bool) -> None:
    """One optimizer step on zero gradients: the state (AdamW's moments, ZeRO-1's shard of them) exists as it does
    from the second training step on. The gradients then are as a step finds them: dropped where the runtime frees
    them, kept where it zeroes them in place (``in_place``: `planner.emit.train.zeroes_grads_in_place`, with any DDP
    module; then the gradients DDP does not reduce, say the experts', outlive the step too). DDP's own are views into
    its buckets from the second step on, so micro-batches accumulate into them and the step does not synchronise
    its first one to attach them; marked, as memory that `_CategoryPeaks.hold_buckets` already holds."""
    params = [p for m in par.modules for p in m.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    ddp = {id(p) for m in par.modules if isinstance(m, torch.nn.parallel.DistributedDataParallel)
           for name, p in m.module.named_parameters() if name not in m.parameters_to_ignore}  # (what its buckets hold)
    for p in params:
        if id(p) in ddp:  # marked, not listed: a second reference would make autograd accumulate out of place
            p.grad._autopar_bucket_view = True
        elif not in_place:
            p.grad = None


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def _vocab(source, seq: int) -> int:
    """The vocabulary of a model whose spec does not say it (a ``file.py`` model), read from the whole model on the
    meta device as the emitted script reads it (a pipeline rank's own part may hold no embedding)."""
    model, _ = source.build(batch=1, seq=seq, device="meta")
    return vocab_size(source, model)
