"""The part of a training step that every ZeRO stage shares (zeroedu.compose builds an engine: initialize()).

This file is the step machinery only; what DeepSpeed's engine offers around it (getters, checkpoints, state dicts,
no_sync, zero_grad) is the DeepSpeedFacade mixin in zeroedu/engine/facade.py, so Engine has both.

A stage decides where parameters, gradients and optimizer state live and which collectives move them
(`zeroedu/engine/stages/`). Everything else is here, once: precision, the loss scale, gradient accumulation,
clipping by the global norm, the optimizer step on fp32 master weights, the ledger and the memory meter.

The optimizer always steps a list of fp32 "master pieces": the whole model at stage 0, this rank's 1/N
pieces at stages 1-3. Adam is elementwise, so stepping pieces of a flat buffer computes exactly what
stepping the original parameters would.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch.utils._pytree import tree_map

from zeroedu.comm import Comm, Handle
from zeroedu.comm.agreement import caller_line
from zeroedu.comm.worker import worker
from zeroedu.config import Config
from zeroedu.engine.facade import DeepSpeedFacade, half_inputs
from zeroedu.engine.report import TIMELINE_KEEP, StepReport, Timeline
from zeroedu.memory import MODEL_STATES, PeakTracker, SavedActivations, resident
from zeroedu.precision import LossScaler, compute_dtype

__all__ = ["TIMELINE_KEEP", "Engine", "Timeline", "compute_device", "make_optimizer"]


def compute_device(model: torch.nn.Module, backend: str) -> torch.device:
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    first = next(model.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def make_optimizer(cfg: Config, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    kind, kw = cfg.optimizer.type, dict(cfg.optimizer.params)
    cls = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW, "SGD": torch.optim.SGD}[kind]
    if kind == "SGD":
        kw.setdefault("lr", 1e-3)
    else:
        # One fused kernel per piece, as DeepSpeed's FusedAdam: on the engine's few large flat pieces torch's
        # default loop runs out of cache (docs/benchmarks.md, "Measurements behind the code").
        kw.setdefault("fused", True)
    return cls(params, **kw)


class Engine(DeepSpeedFacade):
    """What a training step is at every stage. Subclasses fill in where the bytes live.

    The protocol: the hooks below are what a stage (zeroedu/engine/stages/) and an extra (offload, ZeRO++, checkpoints,
    the grader's adapters) override or call; each says its contract in its docstring. An extra uses these and
    public attributes only, never a `_name` of the engine or a stage (tests/test_protocol.py checks it).

    set up      setup() = make_layout() (buckets or units) + place_parameters() (where each rank's parameters
                live), then the gradient buffers and the master pieces
    backward    before_backward(); on_grad_ready(param) per parameter, whose bucket, once complete, gets
                post_backward(bucket) -> reduce_bucket(bucket), which reduces into grad_out(bucket);
                after_backward(). Stage 2's buffers go through take_bucket_slot (a slot and its buffer;
                take_bucket_buffer, the buffer alone, is exercise 5's), move_grads and reduce_scatter_buckets;
                stage 3's units through fetch / release, start_gathers, unit_buffer, and param_piece (what
                a rank sends when a unit is gathered)
    overlap     overlap(fn) runs collectives on the worker's comm lane when overlap_comm is set (at once
                otherwise); overlap(fn, prefetch=True) and submit(fn, lane) always run on a lane ("comm" or
                "io") and return the handle the caller waits for. Everything started is in `in_flight`, which
                wait() drains
    step        grad_pieces() -> optimizer_step(grads, coef) -> publish(), which puts each new master piece
                in its param_home(bucket) by write_back(bucket, master) and gathers; then zero_grads()
    build_optimizer() makes the optimizer over master_pieces (offload: on the host)
    attributes  stage, sharded, partitions_grads, keeps_parameter_copies (extras ask these, not the stage
                number or the class name), layout,
                master_pieces, grad_shard, param_shard; stage 3: units (the coordinator: gathered, inflight,
                unit_buffers), grad_buckets, persistent; in_flight (every handle started, until wait())
    memory      owned() by category (tier_bytes() for other tiers)
    checkpoints master_full(), checkpoint_master(), checkpoint_optimizer_state(), restore_checkpoint()
    """

    stage = -1
    sharded = False      # does each rank own only part of the optimizer state (stages 1-3)?
    partitions_grads = False   # stages 2-3: no full gradient buffer; every micro-step reduces into the shard
    # An extra that keeps the parameters in more places than the shard and the master pieces (offload's host and
    # NVMe tiers, ZeRO++'s secondary partition) sets this; zero.GatheredParameters(modifier_rank=...) refuses it.
    keeps_parameter_copies = False
    # step() with no backward() since the last step raises at once. tests/test_agreement.py turns it off on an
    # engine to reach the collective agreement check behind it with a rank that misuses the engine that way.
    requires_backward_before_step = True
    _decay_runs: list[list[tuple[int, int, float]]] | None = None   # group_decay's layout, made at the first step

    def __init__(self, model: torch.nn.Module, config: Config, comm: Comm | None = None) -> None:
        self.module = model
        self.precision = config.precision
        self.dtype = compute_dtype(self.precision)
        # data_types.grad_accum_dtype: the dtype gradients are summed in over micro-steps (and ranks). fp32 with
        # bf16 costs 2 more bytes per parameter wherever a stage keeps a gradient buffer (18 B/param at stage 0).
        accum = config.data_types.grad_accum_dtype
        self.grad_dtype = compute_dtype(accum) if accum else self.dtype
        if self.grad_dtype != self.dtype and (config.zero_optimization.offload_optimizer.device != "none"
                                              or config.zero_optimization.zero_quantized_gradients):
            raise ValueError("data_types.grad_accum_dtype different from the compute dtype works without "
                             "offload_optimizer and zero_quantized_gradients: remove one of them.")
        self.comm = comm or Comm(implementation=config.comm_implementation)
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        # train_batch_size = micro x accumulation x world size: derived (or checked) now that the world is known.
        self.config = config = config.for_world(self.world_size)
        self.accum = config.gradient_accumulation_steps
        self.overlap_comm = config.zero_optimization.overlap_comm
        self.micro_step = 0
        self.global_step = 0
        self.skipped_steps = 0
        self.scaler = LossScaler.from_config(config.fp16)
        # (phase, start, end) in time.time(), the newest TIMELINE_KEEP to twice that (engine.timeline.keep)
        self.timeline: Timeline = Timeline()
        self.last_peak: PeakTracker | None = None
        self.last_activations: SavedActivations | None = None   # what the last tracked forward saved for backward
        self._tracker: PeakTracker | None = None
        self.in_flight: set[Handle] = set()   # every job this engine started on the worker's lanes, until wait()
        self.log_lines = Timeline()        # what rank 0 printed, on every rank (the newest 5,000-10,000 lines)
        # Where the last optimizer step ended in the timeline and the ledger (absolute: trimming shifts nothing).
        self.step_report = StepReport(self.timeline, self.comm.ledger)
        self._loss_sum: torch.Tensor | None = None
        self.last_loss: float | None = None
        self._warned: set[str] = set()     # warn_if_stuck / warn_if_diverged: each said once

        # Where the model computes: the rank's GPU under NCCL (zeroedu.launch and torchrun set the current
        # device), else where its parameters already are (the CPU under gloo). Every buffer a stage makes
        # (gradient shards, bucket buffers, unit buffers, master pieces) is made on this device.
        self.device = compute_device(model, self.comm.backend)
        if self.stage != 3 and any(getattr(p, "zero_partition", None) is not None for p in model.parameters()):
            raise ValueError(f"this model was built inside zeroedu.zero.Init, so its parameters are partitioned: "
                             f"train it at ZeRO stage 3 (the config asks for stage {self.stage}), or build it "
                             f"without Init.")
        wide = sorted({n for n, p in model.named_parameters() if p.dtype == torch.float64})
        if wide and self.dtype == torch.float32:
            # DeepSpeed 0.19.8 keeps a float64 model in float64 without fp16/bf16 (engine.py casts only for those);
            # zeroedu computes in fp32 there, so a silent cast would train a different model than it would.
            raise ValueError(f"{len(wide)} parameters are float64 ({', '.join(wide[:3])}"
                             f"{', ...' if len(wide) > 3 else ''}); zeroedu trains in fp32 (or bf16/fp16 if the "
                             "config enables them) and would cast them. Call model.float() before initialize() to "
                             "train in fp32, or enable bf16 for mixed precision.")
        model.to(device=self.device, dtype=self.dtype)
        # Parameters that train, each once (a tied weight is one Parameter in two modules).
        self.params = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
        self.names = {p: n for n, p in reversed(list(model.named_parameters(remove_duplicate=False)))}
        with self.comm.in_phase("init"):   # (parameters built inside zeroedu.zero.Init agree already)
            for t in list(dict.fromkeys(model.parameters())) + list(model.buffers()):
                if getattr(t, "zero_partition", None) is None:
                    self.comm.broadcast(t.data, 0, kind="params" if t.is_floating_point() else "other")
        self.setup()
        self.optimizer = self.build_optimizer()
        self.lr_scheduler = self.build_scheduler()
        if config.activation_checkpointing != type(config.activation_checkpointing)():
            # The section configures checkpoint(), process-wide, as in DeepSpeed.
            from zeroedu import activation_checkpointing as checkpointing

            checkpointing.configure(config, ledger=self.comm.ledger)
        for note in config.notes:
            self.log(f"zeroedu note: {note}")
        if config.dump_state:
            self.log(f"zeroedu config: {config.to_dict()}")

    def build_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer over the master pieces (offload builds its host implementation here)."""
        return make_optimizer(self.config, self.master_pieces)

    def build_scheduler(self):
        """The config's `scheduler` over the optimizer, or None (initialize may set a client scheduler instead)."""
        if self.config.scheduler is None:
            return None
        from zeroedu import schedulers

        return schedulers.build(self.config.scheduler.type, self.config.scheduler.params, self.optimizer)

    # -- what a stage provides ---------------------------------------------------------------------------
    master_pieces: list[torch.nn.Parameter]

    def setup(self) -> None:
        """Called once from __init__, after the initial broadcast: make_layout(), then place_parameters(); the
        stages add the gradient buffers, the master pieces and the autograd hooks after these (stage 3: its
        forward hooks too). Sets `layout` and `master_pieces`."""
        self.make_layout()
        self.place_parameters()

    def make_layout(self) -> None:
        """Cut the parameters into buckets (stage 3: units) and set `self.layout` (zeroedu.flat.FlatLayout)."""
        raise NotImplementedError

    def place_parameters(self) -> None:
        """Put this rank's parameters where the stage keeps them (flat buffers; stage 3: this rank's shard)."""
        raise NotImplementedError

    def before_backward(self) -> None:
        """A backward is about to start (every micro-step)."""

    def on_grad_ready(self, param: torch.nn.Parameter) -> None:
        """Autograd's post-accumulate-grad hook: param.grad is complete for this backward. Runs during backward,
        once per parameter that got a gradient; the stage counts them and calls post_backward(bucket) when its
        bucket is complete."""

    def post_backward(self, b) -> None:
        """Bucket (stage 3: unit) b has all its gradients in this backward: its backward is over. The stages
        call it once per bucket per reducing backward, in the same order on every rank; stage 3 releases the
        unit here. Default: reduce_bucket(b)."""
        self.reduce_bucket(b)

    def reduce_bucket(self, b) -> None:
        """Reduce bucket b's gradients over the ranks into grad_out(b) (or, at stage 0, in place). May run the
        collective through overlap(); Engine.backward waits for every one before it returns."""
        raise NotImplementedError

    def grad_out(self, b) -> torch.Tensor:
        """Where bucket b's reduced piece lands (stages 1-3: this rank's piece of the gradient shard). The
        reduction adds into it at stages 2-3 (micro-steps accumulate). Offload: a device staging piece."""
        raise NotImplementedError

    def after_backward(self) -> None:
        """Backward is over (the overlapped collectives may still run: backward() waits for them next)."""

    def grad_pieces(self) -> list[torch.Tensor]:
        """Reduced gradients (compute dtype, summed over ranks / micro-steps), aligned with master_pieces."""
        raise NotImplementedError

    def param_home(self, b) -> torch.Tensor:
        """Where master piece b's values live in the compute parameters on the device, in the compute dtype
        (stage 0: the whole bucket; 1-2: this rank's piece of it; 3: its piece of the parameter shard)."""
        raise NotImplementedError

    def write_back(self, b, master: torch.Tensor) -> None:
        """Put the updated fp32 master piece b into param_home(b), cast to the compute dtype (nothing to do where
        they are one tensor, fp32). Offload overrides it to move the piece between tiers."""
        home = self.param_home(b)
        if master.data_ptr() != home.data_ptr():
            home.copy_(master)

    def publish(self) -> None:
        """After the optimizer step: write_back every master piece, then give every rank the new parameters
        (stages 1-3: all-gathers). Runs only when the step was taken (not on fp16 overflow)."""
        raise NotImplementedError

    def zero_grads(self) -> None:
        """After every optimizer step (taken or skipped): the next step starts from zero gradients."""
        raise NotImplementedError

    def owned(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank holds, by memory category (zeroedu.memory.CATEGORIES)."""
        state = [v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return {
            "parameters": [p.data for p in self.params],
            "master_weights": [p.data for p in self.master_pieces],
            "optimizer_state": [v for v in state if v.dim() > 0],
            "other": [v for v in state if v.dim() == 0] + list(self.module.buffers()),  # step counters, buffers
        }

    # -- the training step -------------------------------------------------------------------------------
    def is_gradient_accumulation_boundary(self) -> bool:
        """True during the backward and step of the last micro-step of an optimizer step (never in no_sync())."""
        return (self.micro_step + 1) % self.accum == 0 and not self.inside_no_sync

    @contextmanager
    def _phase(self, name: str):
        t0 = time.time()
        with self.comm.in_phase(name):
            yield
        self.timeline.append((name, t0, time.time()))

    def forward(self, *args, **kwargs):
        if self.device.type != "cpu":   # inputs follow the model to its GPU, as DDP's do
            args, kwargs = self.to_device((args, kwargs))
        if self.config.fp16.auto_cast and self.precision == "fp16":   # as DeepSpeed: positional inputs only
            args = half_inputs(args)
        with self._phase("forward"):
            if self._tracker is None:
                return self.module(*args, **kwargs)
            with self.saved_activations() as meter:
                out = self.module(*args, **kwargs)
            self.last_activations = meter
            return out

    def saved_activations(self) -> SavedActivations:
        """A meter of the bytes autograd saves for backward (by module), the engine's own tensors left out."""
        owned = [t for ts in self.owned().values() for t in ts]
        return SavedActivations(self.module, [*owned, *self.module.parameters(), *self.module.buffers()])

    def to_device(self, data):
        """Every tensor in `data` (nested lists, tuples, dicts) moved to the engine's device."""
        return tree_map(lambda t: t.to(self.device) if isinstance(t, torch.Tensor) else t, data)

    __call__ = forward

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-step. The loss is divided by the accumulation steps (and scaled for fp16)."""
        detached = loss.detach().float()
        self._loss_sum = detached if self._loss_sum is None else self._loss_sum + detached
        with self._phase("backward"):
            self.before_backward()
            (loss * (self.scaler.scale / self.accum)).backward()
            self.after_backward()
            self.wait()

    @torch.no_grad()
    def step(self) -> None:
        """The optimizer step, at the accumulation boundary only (like DeepSpeed, call it every micro-step)."""
        if self.inside_no_sync:
            raise RuntimeError("engine.step() inside no_sync(): leave the no_sync() block first (its gradients are "
                               "not reduced yet; the next backward outside reduces them), as DeepSpeed requires.")
        boundary = self.is_gradient_accumulation_boundary()
        if boundary and self._loss_sum is None and self.requires_backward_before_step:
            # Stepping on gradients that were never computed would update Adam's step count (and so its bias
            # correction) with no gradient behind it, or fail deep inside a stage; say what is missing instead.
            raise RuntimeError(f"engine.step() at optimizer step {self.global_step + 1} with no engine.backward(loss) "
                               f"since the last step: there are no gradients to step with. Call "
                               f"engine.backward(loss) after each forward, then engine.step().")
        self.micro_step += 1
        if not boundary:
            return
        with self._phase("step"):
            grads = self.grad_pieces()
            clip = self.config.gradient_clipping
            # The global gradient norm, where something needs it: clipping, and fp16's loss scaler (an inf or nan
            # means overflow: skip the step). bf16 and fp32 steps are not checked, as in DeepSpeed and torch.
            norm = self.global_grad_norm(grads) if clip > 0 or self.precision == "fp16" else None
            self.last_grad_norm = norm
            overflow = norm is not None and not math.isfinite(norm)
            if overflow:
                self.skipped_steps += 1
                self.warn_if_stuck()
                self.comm.ledger.note("skipped_step", "step", "scalar", self.global_step, None,
                                      group=self.comm.ranks, sent_bytes=0, impl="-")
            else:
                coef = 1.0 / self.scaler.scale
                if clip > 0:
                    coef *= min(1.0, clip / (norm + 1e-6))
                self.optimizer_step(grads, coef)
                self.publish()
                if self.lr_scheduler is not None:   # as DeepSpeed: a step skipped for overflow does not advance it
                    self.lr_scheduler.step()
            self.scaler.update(overflow)
            self.zero_grads()
            self.wait()
            # Did every rank run the same collectives since the last step? (zeroedu.comm.agreement; one small message)
            self.comm.agree(self.global_step + 1, caller_line())
        self.global_step += 1
        self.comm.step = self.global_step
        if self.config.steps_per_print and self._loss_sum is not None:   # float(): a device sync, only when printed
            self.last_loss = float(self._loss_sum) / self.accum
        self.warn_if_diverged()
        self._loss_sum = None
        self.report_step()

    # Runs that can no longer train say so at the step where it began, once (issue 36: a static loss scale of 1e300
    # skipped every step, and lr 1e30 trained into NaN, without a word).
    def warn_if_stuck(self) -> None:
        """A skipped step with a loss scale that cannot go lower: every later step will overflow and skip too."""
        if self.scaler.dynamic and self.scaler.scale > self.scaler.min_scale or "stuck" in self._warned:
            return
        self._warned.add("stuck")
        why = ("the static fp16.loss_scale" if not self.scaler.dynamic else
               f"fp16.min_loss_scale ({self.scaler.min_scale:g}), the lowest the dynamic scale may go")
        self.warn(f"optimizer step {self.global_step + 1} was skipped: the gradients overflowed (their norm is "
                  f"{self.last_grad_norm}) with a loss scale of {self.scaler.scale:g}, {why}, so the same will "
                  f"happen at every step and the model will not train. Use a dynamic scale (fp16.loss_scale 0), "
                  f"a lower static one, or bf16.")

    def warn_if_diverged(self) -> None:
        """The loss turned inf or nan at this step (checked where reading it costs no device sync: on the CPU,
        or on a step whose loss is printed)."""
        if self._loss_sum is None or "diverged" in self._warned or (
                self.device.type != "cpu" and not self.config.steps_per_print):
            return
        if not bool(torch.isfinite(self._loss_sum)):
            self._warned.add("diverged")
            self.warn(f"the loss is {float(self._loss_sum)} at optimizer step {self.global_step} (the first step "
                      f"whose loss is not finite): training diverged, and every later step computes on inf/nan "
                      f"weights. The learning rate is {self.get_lr()}; lower it, "
                      f"add gradient_clipping, or check the data.")

    def warn(self, text: str) -> None:
        warnings.warn(f"zeroedu: {text}", RuntimeWarning, stacklevel=3)
        self.log(f"zeroedu warning: {text}")

    def global_grad_norm(self, grads: list[torch.Tensor]) -> float:
        """The L2 norm of the whole (unscaled) gradient: the pieces here, summed over ranks if sharded."""
        # In fp32, without an fp32 copy of the gradient.
        norm_sq = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]).square().sum()
        if self.sharded and self.world_size > 1:  # each rank holds part of the gradient
            norm_sq = norm_sq.reshape(1)
            self.comm.all_reduce(norm_sq, average=False, kind="scalar")
        return math.sqrt(float(norm_sq.sum())) / self.scaler.scale

    def optimizer_step(self, grads: list[torch.Tensor], coef: float) -> None:
        """Step the master pieces with grads x coef (unscale and clip in one factor); grads is grad_pieces().
        Leaves master_pieces updated; publish() follows. Offload overrides it to step on the host.

        `sub_group_size`: the pieces are stepped in sub-groups of at most that many elements, one after another
        (a piece is never split), so the fp32 copies of the gradient exist for one sub-group at a time. torch's
        optimizers skip a parameter whose .grad is None, so one optimizer steps each sub-group in turn.
        """
        for group in self.sub_groups():
            for i in group:
                g = grads[i]
                self.master_pieces[i].grad = g if (g.dtype == torch.float32 and coef == 1.0) else g.float().mul_(coef)
            self.group_decay(group)   # per-parameter weight decay, when parameter groups differ in it
            self.optimizer.step()
            for i in group:
                self.master_pieces[i].grad = None

    def group_decay(self, pieces: list[int]) -> None:
        """Weight decay per parameter on master pieces `pieces`, just before the optimizer (built with weight
        decay 0) steps them; Engine.optimizer_step calls it. Groups that differ in weight_decay tag each parameter
        with its own (zeroedu.client); without tags this does nothing. AdamW decays decoupled, as torch's AdamW
        does first in its step (weight x (1 - lr x wd)); Adam and SGD add wd x weight to the gradient (L2), as
        theirs do. Each parameter's run of a piece gets its own group's factor, so this is the same arithmetic."""
        if self._decay_runs is None:
            self._decay_runs = self._decay_layout()
        if not self._decay_runs:
            return
        decoupled = self.config.optimizer.type == "AdamW"
        lr = float(self.optimizer.param_groups[0]["lr"])
        for i in pieces:
            piece = self.master_pieces[i]
            for s, e, wd in self._decay_runs[i]:
                if wd == 0.0:
                    continue
                if decoupled:
                    piece.data[s:e].mul_(1 - lr * wd)
                elif piece.grad is not None:
                    piece.grad[s:e].add_(piece.data[s:e], alpha=wd)

    def _decay_layout(self) -> list[list[tuple[int, int, float]]]:
        """For each master piece, (start, end, weight decay) of each tagged parameter's part of it; [] if no
        parameter is tagged."""
        from zeroedu.client import DECAY_ATTR

        if not any(hasattr(p, DECAY_ATTR) for p in self.layout.params):
            return []
        runs = []
        for b in self.layout.buckets:
            # From the layout, not the piece's storage: offload at nvme empties the pieces between steps.
            lo = self.rank * b.piece if self.sharded else 0
            hi = lo + (b.piece if self.sharded else b.padded)
            mine = []
            for p, off, shape in zip(b.params, b.offsets, b.shapes, strict=True):
                s, e = max(lo, off), min(hi, off + shape.numel())
                if s < e:
                    mine.append((s - lo, e - lo, float(getattr(p, DECAY_ATTR, 0.0))))
            runs.append(mine)
        return runs

    def sub_groups(self) -> list[list[int]]:
        """Indices of the master pieces, greedily grouped into runs of at most sub_group_size elements."""
        limit = self.config.zero_optimization.sub_group_size
        groups: list[list[int]] = []
        size = 0
        for i, piece in enumerate(self.master_pieces):
            if not groups or (size + piece.numel() > limit and groups[-1]):
                groups.append([])
                size = 0
            groups[-1].append(i)
            size += piece.numel()
        return groups

    def train_batch(self, batch, loss_fn) -> float:
        """One micro-step: forward, loss, backward, step. Returns the loss as a float."""
        x, y = self.to_device(batch) if self.device.type != "cpu" else batch
        loss = loss_fn(self(x), y)
        self.backward(loss)
        self.step()
        return float(loss)

    def log(self, text: str) -> None:
        """Print on rank 0 (DeepSpeed's log_dist(ranks=[0])); every rank keeps the line in log_lines."""
        self.log_lines.append(text)       # a long run that prints every step keeps a bounded window
        if self.rank == 0:
            print(text, flush=True)

    def report_step(self) -> None:
        """After an optimizer step: what the logging keys ask for (zeroedu.report.StepReport formats it)."""
        self.step_report.after_step(self)

    # -- overlap: the worker's lanes, and the one set of everything in flight ---------------------------------
    def submit(self, fn: Callable[[], None], lane: str = "comm") -> Handle:
        """Run fn on one of the worker's lanes ("comm": collectives, in order; "io": offload's file reads and
        writes) and return its handle, which joins `in_flight` until wait()."""
        handle = self.comm.run_async(fn) if lane == "comm" else worker().submit(fn, lane)
        if len(self.in_flight) >= 256:   # forwards without a backward (evaluation) never call wait(): stay bounded
            self.in_flight = {h for h in self.in_flight if not h.settled()}
        self.in_flight.add(handle)
        return handle

    def overlap(self, fn: Callable[[], None], prefetch: bool = False) -> Handle | None:
        """Run fn (collectives, and the work that belongs with them) on the comm lane when overlap_comm is set,
        so that backward or the step goes on meanwhile, and return its handle; wait() waits for it. Without
        overlap_comm, run fn now and return None. Jobs run one after another in the order they were given.

        prefetch=True: a stage-3 gather started ahead of need. It runs on the comm lane whatever overlap_comm
        says (a prefetch that blocked would not be one); its owner waits for its handle (fetch()), and wait()
        finds it done."""
        if prefetch or self.overlap_comm:
            return self.submit(fn)
        fn()
        return None

    def wait(self) -> None:
        """Wait for everything in flight (every handle submit() and overlap() returned): backward and step call it
        before they return."""
        while self.in_flight:
            handles, self.in_flight = self.in_flight, set()
            for h in handles:
                h.wait()

    # -- measurement -------------------------------------------------------------------------------------
    @property
    def ledger(self):
        return self.comm.ledger

    @contextmanager
    def track_memory(self):
        """Measure live bytes by category over the enclosed step; the result is `engine.memory()["peak"]`."""
        tracker = PeakTracker(self.owned, lambda: self.comm.phase)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._tracker = tracker
        try:
            with tracker:
                yield tracker
        finally:
            self._tracker = None
        self.last_peak = tracker

    def tier_bytes(self) -> dict[str, dict[str, int]]:
        """Bytes by category on tiers other than the device ("host", "nvme"); offload fills it in."""
        return {}

    def memory(self) -> dict:
        """Bytes on this rank by category, measured from the tensors held now, plus the last tracked peak."""
        res = resident(self.owned())
        report = {
            "resident": res,
            "tiers": {"device": res, **self.tier_bytes()},
            "model_states": sum(res.get(c, 0) for c in MODEL_STATES),
            "peak": dict(self.last_peak.peak) if self.last_peak else None,
            "peak_total": self.last_peak.peak_total if self.last_peak else None,
            "peak_phase": self.last_peak.peak_phase if self.last_peak else None,
            "device": self.device.type,
            # Bytes the last tracked forward saved for backward, in all and by module name (zeroedu.memory).
            "activations": self.last_activations.total if self.last_activations else None,
            "activations_by_module": dict(self.last_activations.by_module) if self.last_activations else None,
        }
        if self.device.type == "cuda":   # the allocator's own figures, next to the tensor-by-tensor ones
            report["cuda_allocated"] = torch.cuda.memory_allocated(self.device)
            report["cuda_peak"] = torch.cuda.max_memory_allocated(self.device)
        return report

    # -- full weights (tests, checkpoints, notebooks) ------------------------------------------------------
    def master_full(self) -> torch.Tensor:
        """The fp32 master weights of the whole model as one flat tensor in layout order (every rank)."""
        raise NotImplementedError

    def checkpoint_master(self) -> list[torch.Tensor]:
        """This rank's fp32 master pieces, aligned with master_pieces, as a checkpoint saves them (zeroedu.checkpoint;
        offload reads them from NVMe)."""
        return [p.data for p in self.master_pieces]

    def checkpoint_optimizer_state(self) -> list[dict]:
        """The optimizer state of each master piece ({} before the first step), as a checkpoint saves it."""
        return [dict(self.optimizer.state.get(p, {})) for p in self.master_pieces]

    def restore_checkpoint(self, master: list[torch.Tensor], state: list[dict] | None) -> None:
        """Load master pieces (and optimizer state, unless None) from a checkpoint; the caller publishes next."""
        for piece, t in zip(self.master_pieces, master, strict=True):
            piece.data.copy_(t)          # in fp32 the master pieces are the parameters themselves
        if state is not None:
            for piece, s in zip(self.master_pieces, state, strict=True):
                self.optimizer.state[piece] = s

    def master_state_dict(self) -> dict[str, torch.Tensor]:
        """{parameter name: fp32 CPU tensor}, the whole model, gathered if it is sharded."""
        full = self.master_full()
        return {self.names[p]: v.to("cpu", copy=True) for p, v in zip(self.layout.params,
                                                                       self.layout.param_views(full), strict=True)}
