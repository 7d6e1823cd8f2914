"""`zeroedu.zero.Init` and `GatheredParameters`, as `deepspeed.zero`: models bigger than one rank.

Stage 3 shards parameters, but `initialize` receives a model that was built whole: every rank must first hold
all of it. `Init` removes that step. Inside it, each module's own parameters are partitioned as soon as the
module's constructor returns: every rank checks that all built the same values (a fingerprint each, all-gathered;
DeepSpeed broadcasts the module from rank 0 instead), then keeps only its 1/N piece, and the parameter itself
becomes an empty tensor. The peak during
construction is therefore this rank's pieces of what was built so far plus the largest module being built
(measured in notebook 12 and tests/test_zero.py). `initialize` at stage 3 then takes the pieces as they are:
its units are the same per-module groups, so no rank ever holds the whole model.

A module built inside Init has parameters that read as empty. Its own constructor's initialisation ran on the
whole tensor, but anything done to the weights afterwards (a custom init loop, tying, copying) must see them
whole: `GatheredParameters(params, modifier_rank=None)` all-gathers them for the `with` block (read only), or,
with `modifier_rank=r`, broadcasts rank r's values when the block ends and writes them back into every rank's
pieces. It works on Init's pieces and on a stage-3 engine's units alike (the engine's fp32 master weights are
updated too), and does nothing for parameters that are not partitioned (stages 0-2), as in DeepSpeed. Every
gather and broadcast is a ledger entry (phase "gather").
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zeroedu.comm import Comm
from zeroedu.config import load_config
from zeroedu.precision import compute_dtype

PHASE = "gather"


def is_partitioned(p: torch.Tensor) -> bool:
    return getattr(p, "zero_partition", None) is not None


def full_shape(p: torch.Tensor) -> torch.Size:
    """A parameter's real shape, also while it is partitioned (DeepSpeed's ds_shape)."""
    return getattr(p, "zero_shape", p.shape)


def _check_same_on_every_rank(params: list[torch.nn.Parameter], comm: Comm) -> None:
    """Every rank keeps its piece of what *it* built, so all must have built the same values. Compare a
    fingerprint per parameter (an fp64 sum: a few bytes on the wire, where DeepSpeed broadcasts the whole
    module from rank 0)."""
    if comm.world_size == 1:
        return
    mine = torch.stack([torch.sum(p.data, dtype=torch.float64) for p in params])
    every = torch.empty(comm.world_size * mine.numel(), dtype=torch.float64, device=mine.device)
    with comm.in_phase("init"):
        comm.all_gather(every, mine, kind="scalar")
    if not torch.equal(every.view(comm.world_size, -1), mine.expand(comm.world_size, -1)):
        raise RuntimeError("zeroedu.zero.Init: the ranks built different parameter values (their random states "
                           "differ), so their pieces would not make one model. Seed the construction the same on "
                           "every rank (torch.manual_seed(seed) before building the model).")


class _Pieces:
    """One module's own parameters as Init keeps them: flattened, padded to N, this rank's 1/N piece."""

    def __init__(self, params: list[torch.nn.Parameter], comm: Comm, dtype: torch.dtype) -> None:
        self.params, self.comm = params, comm
        self.shapes = [p.shape for p in params]
        numel = sum(p.numel() for p in params)
        n = comm.world_size
        self.padded = -(-numel // n) * n
        k = self.padded // n
        lo, hi = comm.rank * k, (comm.rank + 1) * k        # this rank's piece of the flattened group
        self.piece = torch.zeros(k, dtype=dtype, device=params[0].device)
        _check_same_on_every_rank(params, comm)
        off = 0
        for p in params:   # one parameter at a time, each freed at once: the module is never held twice
            data = p.data.to(dtype).contiguous()
            a, b = max(lo, off), min(hi, off + data.numel())
            if a < b:
                self.piece[a - lo: b - lo].copy_(data.reshape(-1)[a - off: b - off])
            off += data.numel()
            p.data = torch.empty(0, dtype=dtype, device=self.piece.device)
            del data
        self.full: torch.Tensor | None = None
        self._empty()

    def _views(self, full: torch.Tensor) -> list[torch.Tensor]:
        views, off = [], 0
        for shape in self.shapes:
            views.append(full[off: off + shape.numel()].view(shape))
            off += shape.numel()
        return views

    def _empty(self) -> None:
        for p, shape in zip(self.params, self.shapes, strict=True):
            p.data = torch.empty(0, dtype=self.piece.dtype, device=self.piece.device)
            p.zero_shape, p.zero_partition = shape, self

    def gather(self) -> None:
        if self.full is not None:
            return
        self.full = torch.empty(self.padded, dtype=self.piece.dtype, device=self.piece.device)
        with self.comm.in_phase(PHASE):
            self.comm.all_gather(self.full, self.piece, kind="params")
        for p, view in zip(self.params, self._views(self.full), strict=True):
            p.data = view

    def release(self, modifier_rank: int | None) -> None:
        if self.full is None:
            return
        if modifier_rank is not None:
            full = self.full
            for p, view in zip(self.params, self._views(full), strict=True):
                if p.data.data_ptr() != view.data_ptr():   # the block replaced p.data: take its values
                    view.copy_(p.data)
            with self.comm.in_phase(PHASE):
                self.comm.broadcast(full, modifier_rank, kind="params")
            k = self.padded // self.comm.world_size
            self.piece.copy_(full[self.comm.rank * k: (self.comm.rank + 1) * k])
        self.full = None
        self._empty()


class _EngineUnit:
    """A stage-3 engine's unit seen the same way: gather = the engine's fetch, write-back into its shard and
    its fp32 master piece."""

    def __init__(self, engine, index: int) -> None:
        self.engine, self.index = engine, index

    def gather(self) -> None:
        with self.engine.comm.in_phase(PHASE):
            self.engine.fetch(self.index)

    def release(self, modifier_rank: int | None) -> None:
        e, b = self.engine, self.engine.layout.buckets[self.index]
        if modifier_rank is not None:
            if e.keeps_parameter_copies:
                raise RuntimeError(f"GatheredParameters(modifier_rank=...) changes weights of a plain stage-3 "
                                   f"engine only, not of {type(e).__name__} (offload / ZeRO++ keep copies "
                                   f"elsewhere): make the change before initialize, inside or after zero.Init.")
            full = e.gathered[self.index]
            for p, view in zip(b.params, e.layout.param_views_of_bucket(full, b), strict=True):
                if p.data.data_ptr() != view.data_ptr():
                    view.copy_(p.data)
            with e.comm.in_phase(PHASE):
                e.comm.broadcast(full, modifier_rank, kind="params")
            mine = full[e.rank * b.piece: (e.rank + 1) * b.piece]
            e.param_home(b).copy_(mine)
            master = e.master_pieces[self.index]
            if master.data_ptr() != e.param_home(b).data_ptr():
                master.data.copy_(mine)
        e.release(self.index)


def adopt(engine) -> None:
    """Called by a stage-3 engine once it holds the shards: its parameters' partitions become its units."""
    for b in engine.layout.buckets:
        unit = _EngineUnit(engine, b.index)
        for p, shape in zip(b.params, b.shapes, strict=True):
            p.zero_shape, p.zero_partition = shape, unit


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: list[type | str],
                        raise_if_not_found: bool = True) -> list[torch.nn.Module]:
    """Mark every module of these classes in `model` as a stage-3 leaf (DeepSpeed's
    deepspeed.utils.set_z3_leaf_modules, the same `_z3_leaf` flag and arguments): call it before initialize().
    A class may be given as the class, or by name ("MoE" or "my_pkg.layers.MoE"), as DeepSpeed accepts.

    A leaf is gathered whole when it starts (every parameter inside it, as one unit) and the modules inside it get
    no hooks. Use it where the modules inside run differently from rank to rank, as a mixture of experts routes
    tokens: every rank then gathers the same units in the same order. An expert no token reached on a rank gets
    no gradient there; when the leaf's backward ends, its missing gradients count as zero (as DeepSpeed's
    leaf hook does), so every rank reduces the leaf's unit at the same point. The leaf's input must require grad:
    that backward end is where the gradient reaches its input."""
    bad = [c for c in leaf_module_classes if not isinstance(c, type | str)]
    if bad:
        raise TypeError(f"leaf_module_classes must hold module classes or their names, got {bad!r}")

    def matches(m: torch.nn.Module, c: type | str) -> bool:
        if isinstance(c, type):
            return isinstance(m, c)
        cls = type(m)
        return c in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")
    found = [m for m in model.modules() if any(matches(m, c) for c in leaf_module_classes)]
    if not found and raise_if_not_found:
        names = ", ".join(c if isinstance(c, str) else c.__name__ for c in leaf_module_classes)
        raise ValueError(f"no module of class {names} in this model: pass the classes of modules it contains")
    for m in found:
        m._z3_leaf = True
    return found


# DeepSpeed 0.19.8's default leaf classes (runtime/zero/leaf_module_config.py): Hugging Face's sparse MoE blocks,
# whose experts run differently from rank to rank. Its engine marks them whether or not a config names any.
DEFAULT_LEAF_MODULE_CLASSES = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)


def apply_leaf_module_config(model: torch.nn.Module,
                             entries: dict[str, list[str]]) -> tuple[list[torch.nn.Module], list[str]]:
    """Mark the leaves a config's zero_optimization.leaf_module names, as DeepSpeed's engine does at initialize
    (deepspeed.utils.z3_leaf_module.apply_zero_leaf_module_config): `classes` (DeepSpeed's three MoE blocks when
    left out), `names` from model.named_modules(), and `name_suffixes`. Returns the modules marked and the notes
    to show: an entry the config gave that matched nothing (DeepSpeed logs a warning and goes on)."""
    given = {k: v for k, v in entries.items() if v is not None}
    classes = given.get("classes", list(DEFAULT_LEAF_MODULE_CLASSES))
    named = dict(model.named_modules())
    marked: dict[int, torch.nn.Module] = {}
    notes = []
    for m in set_z3_leaf_modules(model, classes, raise_if_not_found=False) if classes else []:
        marked[id(m)] = m
    for n in given.get("names", []):
        if n in named:
            named[n]._z3_leaf = True
            marked.setdefault(id(named[n]), named[n])
        else:
            notes.append(f"zero_optimization.leaf_module.names: no module named {n!r} in this model (names are "
                         f"model.named_modules()'s, such as {next(iter(list(named)[1:]), '')!r}); it marks nothing.")
    for suffix in given.get("name_suffixes", []):
        hits = [m for n, m in named.items() if n.endswith(suffix)]
        for m in hits:
            m._z3_leaf = True
            marked.setdefault(id(m), m)
        if not hits:
            notes.append(f"zero_optimization.leaf_module.name_suffixes: no module name ends with {suffix!r}; "
                         "it marks nothing.")
    customized = any(given.get(k, d) != d for k, d in
                     (("classes", list(DEFAULT_LEAF_MODULE_CLASSES)), ("names", []), ("name_suffixes", [])))
    if not marked and customized:
        notes.append("zero_optimization.leaf_module matched no module of this model: stage 3 gathers module by "
                     "module as usual.")
    return list(marked.values()), notes


class GatheredParameters:
    """Make partitioned parameters whole for a `with` block; with `modifier_rank`, keep rank r's changes.

    `params`: a parameter, or an iterable of them (module.parameters()). Parameters that are not partitioned
    pass through untouched. `enabled=False` makes it a no-op (DeepSpeed's signature)."""

    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None, enabled: bool = True) -> None:
        if isinstance(params, torch.Tensor):
            params = [params]
        self.partitions = list(dict.fromkeys(p.zero_partition for p in params if is_partitioned(p))) \
            if enabled else []
        if modifier_rank is not None and dist.is_initialized() and not 0 <= modifier_rank < dist.get_world_size():
            raise ValueError(f"modifier_rank must be a rank in 0..{dist.get_world_size() - 1} (or None to read "
                             f"only), got {modifier_rank}")
        self.modifier_rank = modifier_rank

    def __enter__(self) -> GatheredParameters:
        for part in self.partitions:
            part.gather()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        for part in self.partitions:
            part.release(self.modifier_rank if exc_type is None else None)


def _subclasses(cls: type) -> list[type]:
    out, todo = [], [cls]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in out:
                out.append(sub)
                todo.append(sub)
    return out


class Init:
    """Build modules already partitioned over the data-parallel ranks (DeepSpeed's deepspeed.zero.Init).

    `config`: the run's config (its precision sets the pieces' dtype, as DeepSpeed casts to fp16/bf16);
    `enabled=False` builds normally. torch.distributed must be initialized (zeroedu.launch, torchrun)."""

    def __init__(self, config=None, enabled: bool = True, comm: Comm | None = None) -> None:
        self.enabled = enabled
        self.config = load_config(config)
        self.dtype = compute_dtype(self.config.precision)
        self._comm = comm
        self._patched: dict[type, object] = {}

    def _partition(self, module: torch.nn.Module) -> None:
        params = [p for p in module.parameters(recurse=False) if not is_partitioned(p)]
        if params:
            _Pieces(params, self.comm, self.dtype)

    def _wrap(self, cls: type) -> None:
        if cls in self._patched or "__init__" not in cls.__dict__:
            return
        orig = cls.__dict__["__init__"]
        init = self

        def __init__(module, *args, **kwargs):
            orig(module, *args, **kwargs)
            init._partition(module)

        __init__.__wrapped__ = orig
        self._patched[cls] = orig
        cls.__init__ = __init__

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        if not dist.is_initialized():
            from zeroedu.launch import init_distributed

            init_distributed()
        self.comm = self._comm or Comm(implementation=self.config.comm_implementation)
        for cls in _subclasses(torch.nn.Module):
            self._wrap(cls)
        init = self
        self._old_init_subclass = torch.nn.Module.__dict__.get("__init_subclass__")

        def __init_subclass__(cls, **kwargs):   # classes defined inside the block
            super(torch.nn.Module, cls).__init_subclass__(**kwargs)
            init._wrap(cls)

        torch.nn.Module.__init_subclass__ = classmethod(__init_subclass__)
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        for cls, orig in self._patched.items():
            cls.__init__ = orig
        self._patched = {}
        if self._old_init_subclass is None:
            del torch.nn.Module.__init_subclass__
        else:
            torch.nn.Module.__init_subclass__ = self._old_init_subclass


def consolidated_16bit_state_dict(engine) -> dict[str, torch.Tensor] | None:
    """The whole model's state_dict in the compute dtype, on the CPU, on rank 0 (None elsewhere): gathered one
    unit at a time, so no rank needs the whole model on its device. Keys are the module's own
    (`state_dict()`'s: a tied weight under each name), so a plain nn.Module of the same class loads it."""
    module = engine.module
    out: dict[str, torch.Tensor] = {}
    done: dict[int, torch.Tensor] = {}
    for name, sub in module.named_modules():
        prefix = f"{name}." if name else ""
        with GatheredParameters(list(sub.parameters(recurse=False))):
            for pname, p in sub.named_parameters(recurse=False):
                if id(p) not in done:
                    done[id(p)] = p.data.detach().to("cpu", copy=True)
                out[prefix + pname] = done[id(p)]
        for bname, buf in sub.named_buffers(recurse=False):
            if bname not in sub._non_persistent_buffers_set:
                out[prefix + bname] = buf.detach().to("cpu", copy=True)
    return out if engine.rank == 0 else None


__all__ = ["DEFAULT_LEAF_MODULE_CLASSES", "GatheredParameters", "Init", "adopt", "apply_leaf_module_config",
           "consolidated_16bit_state_dict", "full_shape", "is_partitioned", "set_z3_leaf_modules"]
