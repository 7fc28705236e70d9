"""Every private torch / Inductor name forge uses, in one place (supported: torch 2.11 - 2.13)."""
from __future__ import annotations

import contextlib
import copy
import logging
import re

import torch

from torch.fx.experimental.proxy_tensor import make_fx  # noqa: F401  (public-ish, stable 2.11-2.13)
from torch.nn.utils.stateless import _reparametrize_module as reparametrize_module  # noqa: F401


log = logging.getLogger(__name__)

OpOverload = torch._ops.OpOverload


def op_schema(op):
    """The FunctionSchema of an OpOverload (its argument alias annotations say what it writes)."""
    return op._schema


def op_overload_name(op) -> tuple[str, str]:
    """(op name without namespace, overload name) of an OpOverload."""
    return op._schema.name.split("::")[-1], op._overloadname


def compile_fx(gm, example_inputs):
    """Inductor on a whole-step graph, outside Dynamo.

    Inductor's FX graph cache takes its ShapeEnv from the tracing context; called bare, every compile bypasses
    the cache ("No shape env") and recompiles from scratch in every process (tens of seconds per step graph).
    So the inputs are fakeified here with static shapes in a FakeTensorMode that has a ShapeEnv, under a
    TracingContext of that mode, as Dynamo does for torch.compile.
    """
    from torch._guards import TracingContext, tracing
    from torch._inductor.compile_fx import compile_fx as _compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    if TracingContext.try_get() is not None:
        return _compile_fx(gm, example_inputs)
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    fake_inputs = [fake_mode.from_tensor(t, static_shapes=True) if isinstance(t, torch.Tensor) else t
                   for t in example_inputs]
    with tracing(TracingContext(fake_mode)):
        return _compile_fx(gm, fake_inputs)


@contextlib.contextmanager
def inductor_config_for_forge(free_at_last_use: bool = False):
    """Inductor settings the fused op needs.

    reorder_for_locality can move a read of W below the in-place update, and reinplacing then clones
    the whole weight (see shared NOTES); turning it off costs nothing measurable on these graphs.

    ``free_at_last_use``: Inductor frees each buffer at its last use (``allow_buffer_reuse=False``) instead of
    keeping it allocated until a later allocation of the same size takes it over. In forge's whole-step graph that
    later allocation is often in the backward, so forward buffers whose values are dead stay allocated across the
    forward/backward boundary, where the peak sits (torch.compile's separate forward and backward graphs cannot
    do that). CPU Inductor output of a 1-layer Llama step: 10-22 % of the bytes alive at the boundary were such
    buffers. The cost is one allocator call per buffer instead of none: nothing in a replayed CUDA graph.
    """
    from torch._inductor import config

    patches = dict(reorder_for_locality=False)
    if free_at_last_use:
        patches["allow_buffer_reuse"] = False
    if config.post_grad_custom_post_pass is None:
        patches["post_grad_custom_post_pass"] = _forge_ops_key_pass()
    with config.patch(**patches), _inplace_past_update_orderings():
        yield


# Bumped when _inplace_past_update_orderings changes what Inductor generates (part of the FX graph cache key, through
# _forge_ops_key_pass): a graph cached under other in-place decisions is compiled again.
_SCHEDULER_PATCH_VERSION = "inplace-past-weak-users-1"


@contextlib.contextmanager
def _inplace_past_update_orderings():
    """While forge's graphs compile: Inductor's in-place reuse of a buffer ignores users that only order themselves
    after its producer (``NodeUser.is_weak``: a WeakDep, what a mutation of a buffer the producer READ adds).

    Why: a fused update mutates its weight W in the same graph that reads W in the forward, so Inductor gives every
    buffer computed from W -- the output of ``x @ W.T``, the logits above all -- the update as a weak user, and
    ``decide_inplace_update`` then counts two remaining uses and refuses to write the next value in place. The
    cross-entropy backward's dlogits thereby took a second logits-sized buffer at the step's forward/backward
    boundary (CPU Inductor output of a bf16 Llama step; torch.compile's backward graph, which never sees the update,
    writes dlogits into the saved logits). A weak user never reads the buffer's data: where its only real user
    writes into it, the ordering it stands for (update after the producer) is unchanged. Nothing else is touched;
    if the scheduler's private names differ (another torch), Inductor runs as is."""
    try:
        from torch._inductor import scheduler as _sched

        orig = _sched.BaseSchedulerNode.decide_inplace_update
    except (ImportError, AttributeError):
        yield
        return
    if getattr(orig, "_forge_patched", False):     # nested compiles
        yield
        return

    def decide_inplace_update(self):
        saved = []
        try:
            for read in getattr(getattr(self, "read_writes", None), "reads", ()):
                buf = self.scheduler.name_to_buf.get(read.name)
                users = getattr(buf, "users", None)
                if users and any(getattr(u, "is_weak", False) for u in users):
                    saved.append((buf, users))
                    buf.users = [u for u in users if not getattr(u, "is_weak", False)]
            return orig(self)
        finally:
            for buf, users in saved:
                buf.users = users

    decide_inplace_update._forge_patched = True
    _sched.BaseSchedulerNode.decide_inplace_update = decide_inplace_update
    try:
        yield
    finally:
        _sched.BaseSchedulerNode.decide_inplace_update = orig


def inductor_output_code(fn, *args, **kwargs):
    """(fn's result, the wrapper source of every graph Inductor compiles while it runs), its FX graph cache off so
    that each graph is generated (tests read the step's buffer plan)."""
    from unittest import mock

    from torch._inductor import config
    from torch._inductor.graph import GraphLowering

    codes = []
    with config.patch(fx_graph_cache=False), mock.patch.object(GraphLowering, "save_output_code", codes.append):
        out = fn(*args, **kwargs)
    return out, codes


# a functional collective's buffer in Inductor's Python wrapper: a buffer or graph input name, possibly passed as a
# reinterpret_tensor view of it (an in-place all_reduce_ on a reshaped buffer, tensor parallelism's row-wise output)
_NAME = r"([A-Za-z_]\w*)"
_COLLECTIVE_OUT = re.compile(r"^\s*" + _NAME + r" = torch\.ops\._c10d_functional\.\w+\.default\(")
_COLLECTIVE_INPLACE = re.compile(r"^\s*torch\.ops\._c10d_functional\.\w+_\.default\((?:reinterpret_tensor\()?"
                                 + _NAME + r"\b")
_WAIT = re.compile(r"_c10d_functional\.wait_tensor\.default\((?:reinterpret_tensor\()?" + _NAME + r"\b")
_ALIAS = re.compile(r"^\s*" + _NAME + r" = reinterpret_tensor\(" + _NAME + r"\b")
_IDENT = re.compile(r"\b[A-Za-z_]\w*\b")


def count_collectives(code: str) -> int:
    """How many functional collectives collective_reads_before_wait recognises in ``code``: 0 for a graph with
    collectives means the check could not read this wrapper (cpp_wrapper's C++, another torch's spelling)."""
    return sum(bool(_COLLECTIVE_OUT.match(line) or _COLLECTIVE_INPLACE.match(line)) for line in code.splitlines())


def collective_reads_before_wait(code: str) -> list:
    """The lines of an Inductor Python wrapper ``code`` that hand a functional collective's buffer to a kernel
    before the collective's ``wait_tensor``: each such kernel may read it before the collective wrote it (or write
    it while the collective still reads it). Inductor's scheduler produced one on CPU (a residual add of a
    reduce-scatter's output fused into a kernel placed before the wait: sequence parallel, activation checkpointing,
    Adam updates in the same graph; benchmarks/NOTES_kernel.md, stop 40). Reads Inductor's generated text: a
    wrapper written otherwise (cpp_wrapper, another torch) yields no lines."""
    pending: dict = {}      # buffer (or an alias of it) -> the collective's buffer
    found = []
    for line in code.splitlines():
        stripped = line.strip()
        if m := _WAIT.search(line):
            root = pending.get(m.group(1), m.group(1))
            pending = {b: r for b, r in pending.items() if r != root}
            continue
        if m := _COLLECTIVE_OUT.match(line) or _COLLECTIVE_INPLACE.match(line):
            pending[m.group(1)] = m.group(1)
            continue
        if not pending or stripped.startswith(("#", "assert_", "del ")):
            continue
        if (m := _ALIAS.match(line)) and m.group(2) in pending:
            pending[m.group(1)] = pending[m.group(2)]
            continue
        used = [b for b in _IDENT.findall(line) if b in pending]
        if used:
            found.append(f"{stripped[:120]} (reads {pending[used[0]]} before its wait_tensor)")
    return found


def forge_op_schemas() -> str:
    """The schemas of every registered forge:: op, one per line."""
    return "\n".join(sorted(str(s) for s in torch._C._jit_get_all_schemas() if s.name.startswith("forge::")))


_KEY_PASS: list = []


def _forge_ops_key_pass():
    """A no-op post-grad pass whose uuid -- part of Inductor's FX graph cache key -- is a hash of forge's op
    schemas: a cached graph calls forge's ops by position, so one compiled against other schemas (an older
    forge_compile) must not be loaded (it called wgrad_update_ with 12 arguments after a schema change, stop 35).
    A pass of the user's own (Inductor option ``post_grad_custom_post_pass``) is left in place instead."""
    if not _KEY_PASS:
        import hashlib

        from torch._inductor.custom_graph_pass import CustomGraphPass

        digest = hashlib.sha256((forge_op_schemas() + _SCHEDULER_PATCH_VERSION).encode()).hexdigest()

        class ForgeOpsKey(CustomGraphPass):
            def __call__(self, graph):
                return None

            def uuid(self):
                return f"forge-ops-{digest}"

        _KEY_PASS.append(ForgeOpsKey())
    return _KEY_PASS[0]


def reinplace_missed_bytes() -> int:
    """Bytes Inductor's reinplace pass failed to update in place (each a full clone of a tensor)."""
    from torch._inductor.fx_passes.reinplace import ReinplaceCounters

    return int(ReinplaceCounters.get_total_missed_bytes())


def reset_reinplace_counters() -> None:
    from torch._inductor.fx_passes.reinplace import ReinplaceCounters

    ReinplaceCounters.clear()


def register_dynamo_backend(name, fn):
    from torch._dynamo import list_backends, register_backend

    if name in list_backends(exclude_tags=()):
        return
    register_backend(name=name)(fn)


def aot_autograd(**kwargs):
    from torch._dynamo.backends.common import aot_autograd as _aot

    return _aot(**kwargs)


TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def compile_fx_with_inner(gm, example_inputs, inner_compile, config_patches=None, keep_ops=()):
    """Inductor's AOTAutograd entry with our own ``inner_compile`` (sees ``is_backward=True`` for the
    backward graph) and Inductor ``config_patches`` (as torch.compile's ``options``; compile_fx applies them to
    the backward too). The AOTAutograd cache is off: a cache hit would skip ``inner_compile`` and hand back
    a backward without forge's extra inputs. ``keep_ops``: ops left out of Inductor's decomposition table, so that
    the graphs keep them as single nodes (an unfused one runs as Inductor's fallback: the eager kernel)."""
    from torch._functorch import config as functorch_config
    from torch._inductor.compile_fx import compile_fx as _compile_fx
    from torch._inductor.decomposition import select_decomp_table

    decompositions = None
    if keep_ops:
        decompositions = {op: fn for op, fn in select_decomp_table().items() if op not in keep_ops}
    with functorch_config.patch(enable_autograd_cache=False):
        return _compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=config_patches or None,
                           decompositions=decompositions)


def cudagraph_unsafe_tags() -> tuple:
    """The op tag that keeps an op out of Inductor's CUDA graphs (absent in old torch: no tag)."""
    tag = getattr(torch.Tag, "cudagraph_unsafe", None)
    return (tag,) if tag is not None else ()


def inductor_option_names() -> set:
    """The names ``torch.compile(..., options=...)`` accepts for Inductor (its config options)."""
    import torch._inductor

    return set(torch._inductor.list_options())


@contextlib.contextmanager
def inductor_config_patch(patches):
    """Inductor config ``patches`` (a dict of option names, possibly empty) for the block."""
    from torch._inductor import config

    with config.patch(dict(patches or {})):
        yield


def inline_compiled_functions():
    """While forge traces a step: a torch.compile'd module or function the step calls (``torch.compile(model)``) is
    traced through as plain Python -- the whole step is compiled anyway -- instead of Dynamo refusing to run under
    FX tracing ("Detected that you are using FX to symbolically trace a dynamo-optimized function")."""
    import torch._dynamo

    return torch._dynamo.config.patch(error_on_nested_fx_trace=False)


def compile_fx_inner(gm, example_inputs, **kwargs):
    """Inductor's compile_fx_inner. With ``cpp_wrapper=True`` it first applies the Triton settings the C++ wrapper
    needs (``store_cubin``, ...): compile_fx applies them only while it runs, and a backward compiled lazily at
    its first call (the backend route's) comes after that, so torch 2.11 compiled it without them and failed on
    the GPU ("CudaKernelParamCache not populated"); torch 2.13's compile_fx_inner applies them itself."""
    from torch._inductor import compile_fx as cfx, config

    if not kwargs.get("cpp_wrapper"):
        return cfx.compile_fx_inner(gm, example_inputs, **kwargs)
    try:
        patches = cfx.get_cpp_wrapper_config(log_cudagraph_skip=False)
    except TypeError:      # torch 2.11: no argument
        patches = cfx.get_cpp_wrapper_config()
    with config.patch(patches):
        return cfx.compile_fx_inner(gm, example_inputs, **kwargs)


def detect_fake_mode(inputs):
    from torch._guards import detect_fake_mode as _detect

    return _detect(inputs)


def is_real_tensor_in_fake_trace(exc: BaseException) -> bool:
    """Whether a fake-mode trace failed because an op met a real tensor: one the traced function read from somewhere
    other than its inputs (FakeTensorMode's message; torch 2.11-2.13)."""
    return isinstance(exc, AssertionError) and "convert all Tensors to FakeTensors" in str(exc)


def outside_fake_mode():
    """A context in which tensor ops run on real tensors even inside a FakeTensorMode (AOTAutograd compiles a
    dynamic-shape graph's backward eagerly under the forward's fake mode, where forge reads real optimizer
    states)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def is_rng_state_placeholder(node) -> bool:
    """An input AOTAutograd's partitioner appends to a forward graph after its primals: the CUDA generator state
    of a random op recomputed in the backward (graph-safe RNG functionalization; a checkpointed region with SDPA,
    whose CUDA kernels are tagged nondeterministic_seeded, has one). The runtime passes it; Dynamo never sees it."""
    return isinstance(node.meta.get("val"), torch.Generator) or node.name.startswith("fwd_rng_state_")


_DTENSOR_TYPE: list = []


def is_dtensor(t) -> bool:
    """A torch.distributed DTensor (FSDP2's sharded parameters, tensor parallelism). Called per step input by
    compile_train_step: the class is looked up once."""
    if not _DTENSOR_TYPE:
        if torch.distributed.is_available():
            from torch.distributed.tensor import DTensor
            _DTENSOR_TYPE.append(DTensor)
        else:
            _DTENSOR_TYPE.append(())
    return isinstance(t, _DTENSOR_TYPE[0])


def dtensor_spec(t):
    """A DTensor's spec (mesh, placements, global shape and stride): what a traced step needs to wrap its local
    tensor again (tensor_parallel.py)."""
    return t._spec


def dtensor_from_local(local, spec):
    """A DTensor whose local tensor IS ``local`` (``DTensor.from_local`` wraps a ``view_as`` of it: a traced update
    of the parameter would then write a view, not the graph's input)."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, spec, requires_grad=False)


def active_ddp_module():
    """The DistributedDataParallel module whose forward is running now, or None (one attribute read)."""
    if not torch.distributed.is_available():
        return None
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel._get_active_ddp_module()


def data_parallel_wrapper(modules=(), params=(), allow_ddp: bool = False) -> str | None:
    """The data-parallel wrapper whose gradient synchronisation a fused update would bypass, or None:
    DistributedDataParallel (its all-reduce runs in autograd hooks on the gradient accumulators; while its forward
    runs, Dynamo compiles the wrapped module under ``_get_active_ddp_module``), FSDP (FullyShardedDataParallel;
    its original parameters carry ``_fsdp_flattened``) and FSDP2 (``fully_shard`` makes modules ``FSDPModule``).
    ``allow_ddp``: DistributedDataParallel is not asked about (compile_train_step reproduces its synchronisation)."""
    if not torch.distributed.is_available():
        return None
    from torch.nn.parallel import DistributedDataParallel

    if not allow_ddp and active_ddp_module() is not None:
        return "DistributedDataParallel"
    types = [] if allow_ddp else [DistributedDataParallel]
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
        types.append(FullyShardedDataParallel)
        from torch.distributed.fsdp import FSDPModule
        types.append(FSDPModule)
    except ImportError:
        pass
    types = tuple(types)
    for m in modules:
        for sub in m.modules():
            if isinstance(sub, types):
                return "FSDP2 (fully_shard)" if type(sub).__name__.startswith("FSDP") else type(sub).__name__
    if any(getattr(p, "_fsdp_flattened", False) for p in params):
        return "FullyShardedDataParallel"
    return None


def ddp_wrappers(modules=()) -> list:
    """The DistributedDataParallel modules among ``modules`` and their submodules, each once."""
    if not torch.distributed.is_available():
        return []
    from torch.nn.parallel import DistributedDataParallel

    out, seen = [], set()
    for m in modules:
        for sub in m.modules():
            if isinstance(sub, DistributedDataParallel) and id(sub) not in seen:
                seen.add(id(sub))
                out.append(sub)
    return out


def ddp_unsupported(ddp) -> str | None:
    """Why compile_train_step cannot reproduce this DistributedDataParallel's gradient synchronisation in its graph
    (the mean over ranks of every synchronised gradient, buffers broadcast from rank 0 before the forward), or
    None. Reads DDP's private configuration (torch 2.11-2.13)."""
    if getattr(ddp, "_comm_hooks", None):
        return "a communication hook is registered (register_comm_hook): its reduction is not the mean"
    logged = ddp._get_ddp_logging_data() if hasattr(ddp, "_get_ddp_logging_data") else {}
    if logged.get("comm_hook"):      # a built-in hook (_register_builtin_comm_hook) is logged only
        return f"a communication hook is registered ({logged['comm_hook']}): its reduction is not the mean"
    if getattr(ddp, "_use_python_reducer", False):
        return "DDP's Python reducer (compiled_autograd / _DDP_WITH_REPLICATED_TENSOR mode)"
    if getattr(ddp, "mixed_precision", None) is not None:
        return "DDP's mixed_precision option"
    if getattr(ddp, "_delay_all_reduce_all_params", False):
        return "DDP's delayed all-reduce of all parameters (_set_ddp_sink_clone / delay_all_reduce)"
    return None


def ddp_group(ddp):
    """(the name functional collectives know its process group by, world size) of a DistributedDataParallel."""
    return ddp.process_group.group_name, ddp.process_group.size()


def ddp_synced(ddp) -> bool:
    """Whether a backward run now would all-reduce (False inside ``no_sync()``)."""
    return bool(ddp.require_backward_grad_sync)


def ddp_ignored(ddp) -> set:
    """Fully qualified names (relative to ``ddp.module``) of parameters and buffers DDP leaves alone."""
    return set(getattr(ddp, "parameters_to_ignore", ()) or ())


# functional collectives (torch.ops._c10d_functional: traced by make_fx, lowered by Inductor)
C10D_ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
C10D_ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
C10D_BROADCAST = torch.ops._c10d_functional.broadcast.default
C10D_WAIT = torch.ops._c10d_functional.wait_tensor.default


def all_reduce_sum(t, group_name: str):
    return C10D_WAIT(C10D_ALL_REDUCE(t, "sum", group_name))


def broadcast_from(t, src: int, group_name: str):
    return C10D_WAIT(C10D_BROADCAST(t, src, group_name))


def group_size(group_name: str) -> int:
    import torch.distributed.distributed_c10d as c10d

    return c10d._resolve_process_group(group_name).size()


def optimizer_step_hooks(opt) -> list:
    """The hooks ``opt.step()`` calls besides the update: the optimizer's own (``register_step_pre_hook`` /
    ``register_step_post_hook``) and the global ones (``register_optimizer_step_pre_hook`` / ``_post_hook``), less
    forge's own (marked ``_forge_internal``). Private dicts, the same in torch 2.11-2.13."""
    from torch.optim import optimizer as _opt

    out = [*opt._optimizer_step_pre_hooks.values(), *opt._optimizer_step_post_hooks.values()]
    out += [h for d in (_opt._global_optimizer_pre_hooks, _opt._global_optimizer_post_hooks) for h in d.values()
            if not getattr(h, "_forge_internal", False)]
    return out


def auto_functionalized():
    """The higher-order op functionalization writes a mutating custom op as (``auto_functionalized``)."""
    return torch.ops.higher_order.auto_functionalized


def mark_optimizer_stepped(opt) -> None:
    """forge updates parameters without calling ``opt.step()``; tell LR schedulers it happened
    (they warn about 'lr_scheduler.step() before optimizer.step()' otherwise)."""
    opt._opt_called = True


# -- the Dynamo route's lazily compiled unfused backward (backend.py) --------------------------------


def saved_compile_contexts():
    """AOTAutograd compiles the backward inside the forward's TracingContext/CompileContext; the
    unfused variant is compiled later (on first need) inside the same ones, as AOT's lazy backward is."""
    from torch._guards import CompileContext, TracingContext

    return TracingContext.try_get(), CompileContext.try_get()


@contextlib.contextmanager
def in_compile_contexts(saved):
    from torch._guards import compile_context, tracing

    tracing_ctx, compile_ctx = saved
    with tracing(tracing_ctx), compile_context(compile_ctx):
        yield


def will_accumulate(acc_node) -> bool:
    """Whether the running backward will write ``.grad`` through this AccumulateGrad node: False
    under ``torch.autograd.grad`` (torch raises for leaves there) or ``backward(inputs=...)``
    without this parameter. When torch cannot tell, False: the caller then runs unfused (safe)."""
    try:
        return bool(torch._C._will_engine_execute_node(acc_node))
    except (RuntimeError, AttributeError):
        return False


def gradient_hooks(t) -> list:
    """The hooks autograd calls with ``t``'s gradient -- ``Tensor.register_hook`` and
    ``register_post_accumulate_grad_hook`` ones (private dicts, the same in torch 2.11-2.13) -- less forge's own
    (marked ``_forge_internal``). Two attribute reads when there are none (~0.1 us each)."""
    out = []
    for d in (t._backward_hooks, t._post_accumulate_grad_hooks):
        if d:
            out.extend(h for h in d.values() if not getattr(h, "_forge_internal", False))
    return out


def foreach_copy_(dst: list, src: list) -> None:
    """``d.copy_(s)`` for each pair, as one multi-tensor kernel where the tensors share device and dtype."""
    torch._foreach_copy_(dst, src)


def deepcopy_graph_module(gm):
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return copy.deepcopy(gm)


def drop_stale_user_visible_outputs(gm) -> None:
    """compile_fx records which backward outputs are user visible (their strides kept) before our
    inner_compile runs; forge then turns fused gradients into None outputs. A stale index makes
    Inductor's padding pass (on by default on CUDA: comprehensive_padding) read ``None.target``."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    idxs = out.meta.get("user_visible_output_idxs")
    if idxs is None:
        return
    args = out.args[0] if not isinstance(out.args[0], torch.fx.Node) else out.args
    out.meta["user_visible_output_idxs"] = [i for i in idxs if i < len(args) and isinstance(args[i], torch.fx.Node)]


# -- Triton internals (triton 3.6) --------------------------------------------------------------------------------

def _triton_stream_fns():
    active = __import__("triton").runtime.driver.active
    return active.get_current_device, active.get_current_stream


class TritonDirectLaunch:
    """Enter the C launcher of a compiled Triton/Gluon kernel straight, for launch_memo's repeated launches.

    ``CompiledKernel[grid](*args)`` goes through Python layers that redo, at every launch, work whose result a
    memoized launch already knows: the launch-metadata dict for the (empty) launch hooks, scratch allocation
    (none for our kernels) and, for every host tensor descriptor, ``cuTensorMapEncodeTiled`` (triton's
    ``make_tensordesc_arg``; the 5-descriptor Gluon kernel's launch cost 72 us vs 24 for the Triton kernel on the
    H200 host, benchmarks/RESULTS.md). Here ``expand`` encodes each descriptor once (the memo key pins its base
    pointer, shape and strides) and turns tensors into integer pointers (the C launcher then skips its
    ``data_ptr()`` call and ``cuPointerGetAttribute``); ``__call__`` passes the expanded arguments on.

    Built by ``build``; None whenever the launcher is not laid out as in triton 3.6 (the caller keeps
    ``CompiledKernel[grid]``). ``usable()`` is False while launch hooks are registered (proton): they need the
    launch metadata this path does not build."""

    __slots__ = ("raw", "rest", "grid", "td_index", "td_meta", "encode", "device_fn", "stream_fn", "knobs")

    @classmethod
    def build(cls, compiled, grid):
        try:
            import triton
            from triton import knobs
            from triton.backends.nvidia import driver as nv

            if not triton.__version__.startswith("3.6."):   # the layout below is triton 3.6's (3.9 differs)
                return None
            launcher = compiled.run                       # CudaLauncher (loads the module on first use)
            if not isinstance(launcher, nv.CudaLauncher):
                return None
            if launcher.global_scratch_size or launcher.profile_scratch_size:
                return None
            launch = launcher.launch
            code = getattr(launch, "__code__", None)
            if code is None:                              # no descriptor argument: the C function itself
                raw, td_index, td_meta = launch, (), []
            else:                                         # wrap_handle_tensordesc's closure over the C function
                cells = dict(zip(code.co_freevars, (c.cell_contents for c in launch.__closure__ or ())))
                raw, td_meta = cells["launcher"], cells["tensordesc_meta"]
                td_index = sorted(cells["tensordesc_indices"])
                if getattr(raw, "__code__", None) is not None or len(td_meta) != len(td_index):
                    return None
            self = cls()
            self.raw = raw
            self.grid = tuple(grid) + (1,) * (3 - len(grid))
            self.rest = (compiled.function, launcher.launch_cooperative_grid, launcher.launch_pdl, None, None,
                         compiled.packed_metadata, None, None, None)
            self.td_index = {i: j for j, i in enumerate(td_index)}
            self.td_meta = list(td_meta)
            self.encode = nv.make_tensordesc_arg
            self.device_fn, self.stream_fn = _triton_stream_fns()
            self.knobs = knobs.runtime
            return self
        except Exception as e:   # any other layout: the caller keeps the public launcher
            log.debug("forge: no direct launch (%s: %s)", type(e).__name__, e)
            return None

    def usable(self) -> bool:
        rt = self.knobs
        for hook in (rt.launch_enter_hook, rt.launch_exit_hook):
            if hook is not None and getattr(hook, "calls", True):
                return False
        return True

    def expand(self, args, first: int) -> list:
        """Kernel arguments ``args`` (positions ``first``, ``first + 1``, ... of the signature) as the C launcher
        takes them: descriptors encoded, objects with ``data_ptr`` as integers."""
        out = []
        for i, a in enumerate(args, first):
            j = self.td_index.get(i)
            if j is not None:
                out.extend(p.data_ptr() if hasattr(p, "data_ptr") else p for p in self.encode(a, self.td_meta[j]))
            elif hasattr(a, "data_ptr"):
                out.append(a.data_ptr())
            else:
                out.append(a)
        return out

    def __call__(self, head, scalars, tail) -> None:
        g = self.grid
        self.raw(g[0], g[1], g[2], self.stream_fn(self.device_fn()), *self.rest, *head, *scalars, *tail)
