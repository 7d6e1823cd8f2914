"""Bytes per rank by category, measured from live tensors.

Two measurements, neither computed from a formula:
- `resident(owned)`: walk the tensors the engine holds, by category, and add up the bytes of their storages
  (each storage once, so views and aliases are not double counted).
- `PeakTracker`: a TorchDispatchMode that sees every tensor an operator creates. It keeps a weak reference
  to each storage, so it knows which are still alive after every operator, and records the highest total
  and what it was made of. Storages the engine owns are labelled with the engine's category (gradient,
  gathered parameters, bucket ...); anything else is labelled by when it was made: "activations" in
  forward, "temporaries" in backward and step. On CUDA the allocator's own peak is reported next to it.

Ring temporaries made on the comm thread (one chunk at a time) are not seen by the tracker.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Iterable
from contextlib import contextmanager

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from zeroedu.theory.vocab import MODEL_STATES  # noqa: F401 (engine and course import it from here)

CATEGORIES = ("parameters", "gradients", "master_weights", "optimizer_state", "buckets",
              "gathered_parameters", "activations", "temporaries", "other")


def resident(owned: dict[str, Iterable[torch.Tensor]]) -> dict[str, int]:
    """Bytes of the storages behind `owned` tensors, per category; a storage counts once, first category wins."""
    seen: set[int] = set()
    out = dict.fromkeys(owned, 0)
    for cat, tensors in owned.items():
        for t in tensors:
            if t is None or not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            if st.nbytes() == 0 or st.data_ptr() in seen:
                continue
            seen.add(st.data_ptr())
            out[cat] += st.nbytes()
    return out


_UNTRACKED = threading.local()


@contextmanager
def untracked():
    """Tensors made inside are not the training's memory and are left out of a PeakTracker's count: the
    collective agreement check's 2 KB messages (zeroedu.comm.agreement), which live for as long as the other
    ranks take to answer, so that counting them would make a measured peak depend on timing."""
    before = getattr(_UNTRACKED, "on", False)
    _UNTRACKED.on = True
    try:
        yield
    finally:
        _UNTRACKED.on = before


class PeakTracker(TorchDispatchMode):
    """Live bytes after every operator, by category; the peak and its breakdown.

    `owned()` returns the engine's tensors by category at the moment of asking; `phase()` returns the
    current phase ("forward", "backward", "step").
    """

    def __init__(self, owned: Callable[[], dict[str, Iterable[torch.Tensor]]], phase: Callable[[], str]) -> None:
        super().__init__()
        self._owned = owned
        self._phase = phase
        self.live: dict[StorageWeakRef, tuple[int, str]] = {}
        self.peak_total = 0
        self.peak: dict[str, int] = {}
        self.peak_phase = ""
        self._labels: dict[int, str] = {}
        self.track_resizes = True

    def _label_owned(self) -> None:
        self._labels = {}
        for cat, tensors in self._owned().items():
            for t in tensors:
                if isinstance(t, torch.Tensor):
                    self._labels.setdefault(t.untyped_storage()._cdata, cat)

    def _add(self, t: torch.Tensor, default: str) -> None:
        st = t.untyped_storage()
        if st.nbytes() == 0:
            return
        ref = StorageWeakRef(st)
        if ref not in self.live:
            self.live[ref] = (st.nbytes(), default, st._cdata)   # _cdata: the storage's identity

    def __enter__(self):
        for tensors in self._owned().values():
            for t in tensors:
                if isinstance(t, torch.Tensor):
                    self._add(t, "other")
        self._snapshot()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(_UNTRACKED, "on", False):
            return out
        phase = self._phase()
        default = "activations" if phase == "forward" else "temporaries"
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t, default)
        self._snapshot()
        return out

    def _sizes(self) -> dict[int, int]:
        """Current bytes of the engine's storages (stage 3 resizes its gathered buffers in place)."""
        sizes = {}
        for tensors in self._owned().values():
            for t in tensors:
                if isinstance(t, torch.Tensor):
                    st = t.untyped_storage()
                    sizes[st._cdata] = st.nbytes()
        return sizes

    def _snapshot(self) -> None:
        for ref in [r for r in self.live if r.expired()]:
            del self.live[ref]
        sizes = self._sizes() if self.track_resizes else {}
        total = sum(sizes.get(v[2], v[0]) for v in self.live.values())
        if total > self.peak_total:
            self.peak_total = total
            self.peak_phase = self._phase()
            self._label_owned()
            by: dict[str, int] = defaultdict(int)
            for nbytes, default, ptr in self.live.values():
                by[self._labels.get(ptr, default)] += sizes.get(ptr, nbytes)
            self.peak = dict(by)

    def current(self) -> int:
        self._snapshot()
        sizes = self._sizes()
        return sum(sizes.get(v[2], v[0]) for v in self.live.values())



class SavedActivations:
    """Bytes autograd saves for backward while it is active: the "activations" of the memory categories.

    A saved-tensor hook sees every tensor an operator keeps for its backward (a Linear's input, a softmax's
    output, a LayerNorm's mean and rstd ...). Each storage counts once, with its bytes when first saved, and
    goes to the innermost module of `root` that was running (by name, "" for the root itself); storages in
    `exclude` (parameters, the engine's buffers) are not activations. The hook hands autograd a detached alias
    of the tensor (same storage): returning the tensor itself would make a reference cycle through its grad_fn
    that keeps it alive after backward. Storages the engine makes while the meter runs are not excluded: pass
    `exclude` what is parameters and buffers for good.
    """

    def __init__(self, root: torch.nn.Module | None = None, exclude: Iterable[torch.Tensor] = ()) -> None:
        self.names = {m: n for n, m in root.named_modules()} if root is not None else {}
        # Storages are known by address; a weak reference to each keeps its address from being reused by a new
        # storage while the meter runs (stage 3 frees and makes parameter storages mid-forward), without
        # keeping its bytes alive.
        self.exclude = {t.untyped_storage()._cdata: StorageWeakRef(t.untyped_storage())
                        for t in exclude if isinstance(t, torch.Tensor)}
        self.by_module: dict[str, int] = defaultdict(int)
        self._seen: dict[int, StorageWeakRef] = {}
        self._stack: list[str] = [""]
        self._handles: list = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    @property
    def total(self) -> int:
        return sum(self.by_module.values())

    def under(self, prefix: str) -> int:
        """Bytes saved inside the module called `prefix` (e.g. "blocks.0") and its submodules."""
        return sum(v for k, v in self.by_module.items() if k == prefix or k.startswith(prefix + "."))

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        key = st._cdata
        if key not in self._seen and key not in self.exclude:
            self._seen[key] = StorageWeakRef(st)
            self.by_module[self._stack[-1]] += st.nbytes()
        return t.detach()

    def _enter_module(self, m: torch.nn.Module, args) -> None:
        self._stack.append(self.names.get(m, self._stack[-1]))

    def _leave_module(self, m: torch.nn.Module, args, out) -> None:
        if len(self._stack) > 1:
            self._stack.pop()

    def __enter__(self) -> SavedActivations:
        _ACTIVE.append(self)
        if self.names:
            self._handles = [torch.nn.modules.module.register_module_forward_pre_hook(self._enter_module),
                             torch.nn.modules.module.register_module_forward_hook(self._leave_module,
                                                                                  always_call=True)]
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles = []
        _ACTIVE.remove(self)


_ACTIVE: list[SavedActivations] = []


@contextmanager
def saved_by(module: torch.nn.Module):
    """Attribute what is saved inside this block to `module` in every active SavedActivations (a checkpoint
    saves its inputs after its function returned, outside the module's own forward)."""
    for meter in _ACTIVE:
        meter._stack.append(meter.names.get(module, meter._stack[-1]))
    try:
        yield
    finally:
        for meter in _ACTIVE:
            meter._stack.pop()


class MemoryCap(PeakTracker):
    """A device of `limit` bytes, for demos: when the live bytes of tensors made inside the block exceed it, the
    operator that made them raises torch.OutOfMemoryError, as a GPU of that size would. It counts tensor
    storages (what PeakTracker counts), not the process's memory; `peak_total` says how close it came."""

    def __init__(self, limit: int) -> None:
        super().__init__(dict, lambda: "capped")
        self.limit = int(limit)

    def __enter__(self):
        import torch._dynamo  # noqa: F401  (nn.Linear imports it on first use: not under the cap, it is slow)

        return super().__enter__()

    def watch(self, owned: Callable[[], dict[str, Iterable[torch.Tensor]]]) -> None:
        """Follow these tensors' storages as they shrink and grow in place (stage 3 frees a gathered unit by
        resizing its storage to 0 bytes): pass `engine.owned` once the engine exists."""
        self._owned = owned

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.peak_total > self.limit:
            total, self.peak_total = self.peak_total, 0   # reported once
            raise torch.OutOfMemoryError(f"zeroedu.memory.MemoryCap: {func} brought live tensors to {total:,} bytes, "
                                         f"over this rank's cap of {self.limit:,} bytes")
        return out
