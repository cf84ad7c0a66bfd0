"""Pipeline parallel with torch.distributed.pipelining: rank r holds a contiguous run of
decoder layers (the embedding on the first stage, final norm and LM head on the last);
activations travel rank to rank by point-to-point sends.

A stage is the model's own forward with the other stages' layers replaced by pass-throughs
(StageModule): masks (sliding window, per-layer attention types), rotary embeddings and norms
are the model's code, not a re-implementation (distlab.strategies.pp_stages). Which children run before and after the
layers comes from the model's `base_model_pp_plan`; families without one, or with tied
embeddings, are refused at config time (distlab.configuration.families). Each rank builds the model on the
meta device and reads from the safetensors only the weights of its stage
(distlab.runtime.partial_load): no rank ever holds the whole model.

Each loop micro-batch is cut into pp.microbatches pipeline micro-batches and run by the
schedule the spec names (GPipe: all forwards, then all backwards; 1F1B: interleaved so
at most p activations are alive). The loss exists only on the last stage; the other
stages return None to the loop. Every stage reads the same batch (the first uses the
tokens, the last the labels): the data-parallel size is 1.

The bubble is measured, not only computed: each rank times the compute it does inside
a schedule step (stage forward, loss, stage backward) against the step's wall time;
the rest is time spent waiting on neighbours. Written per rank to run_files/pipeline-rank<r>.json
after each step (outside the step timer), next to the formula (p-1)/(m+p-1).
"""
from __future__ import annotations

import json
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from distlab.checkpoint_formats.dcp import dcp_load, dcp_save
from distlab.runtime.model import decoder_layers
from distlab.configuration.model_files import empty_model
from distlab.runtime.partial_load import load_held_weights
from distlab.configuration.precision import autocast
from distlab.records.run_layout import run_files_dir
from distlab.strategies.base import FidelityError, ModelParallel, Strategy
from distlab.strategies.pp_stages import StageModule, bubble_formula, prune_to_stage, split_layers

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class ComputeTimer:
    """Seconds spent inside `with timer:` blocks. On CUDA, kernels run after the Python call
    returns, so each block is bracketed by CUDA events on the current stream and read after
    the step's synchronize: the GPU's own busy span, without adding a synchronize per block."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.seconds = 0.0
        self.events = []
        self.depth = 0  # a block inside another is already counted by the outer one

    def __enter__(self):
        self.depth += 1
        if self.depth > 1:
            return
        if self.cuda:
            self.events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
            self.events[-1][0].record()
        else:
            self._start = time.perf_counter()

    def __exit__(self, *exc):
        self.depth -= 1
        if self.depth:
            return False
        if self.cuda:
            self.events[-1][1].record()
        else:
            self.seconds += time.perf_counter() - self._start
        return False

    def take(self) -> float:
        """Busy seconds since the last take (CUDA: call after synchronize)."""
        busy = self.seconds + sum(start.elapsed_time(end) for start, end in self.events) / 1000
        self.seconds, self.events = 0.0, []
        return busy


class PipelineParallelStrategy(ModelParallel, Strategy):
    name = "pp"
    expected_wrappers = ("PipelineStage",)

    def training_modules(self):
        return [self.model, self.stage_module]  # the stage wrapper the schedule calls, and the model

    def load_model(self, model_source: str):
        """A meta-device skeleton: wrap() keeps this stage's part and loads only its weights."""
        return empty_model(model_source)

    def wrap(self, model) -> None:
        if self.spec.method != "full":
            raise NotImplementedError("pipeline parallel runs full fine-tuning only")
        rank, world = dist.get_rank(), dist.get_world_size()
        self.bounds = split_layers(len(decoder_layers(model)), world)
        self.first, self.last = rank == 0, rank == world - 1
        keep = self.bounds[rank]
        first_layer = prune_to_stage(model, keep, self.first, self.last)
        # Only now, with other stages' parts gone, read this stage's weights from the folder.
        self.loaded_bytes = load_held_weights(model, self.ctx.device)
        self.stage_module = StageModule(model, first_layer, self.first, self.last)
        self.model = model  # the pruned HF model: parameter names stay Hugging Face names
        self.n_pipe = self.spec.pp["microbatches"]
        self.stage = PipelineStage(self.stage_module, rank, world, self.ctx.device)
        # scale_grads=False: each piece's loss below is its summed token loss over the step's
        # token count (distlab.runtime.accumulation), so the accumulated gradients need no rescaling.
        self.schedule = SCHEDULES[self.spec.pp["schedule"]](self.stage, self.n_pipe, loss_fn=self._loss,
                                                               scale_grads=False)
        self.optimizer = self.build_optimizer(self.trainable(model))
        self._num_items = None  # the step's label-token count, set per micro-batch
        self.compute = ComputeTimer(self.ctx.device)
        self._timings: list[dict] = []
        self._step_wall = self._step_busy = 0.0
        self._time_stage_compute()

    def _loss(self, logits, labels):
        with self.compute:
            summed = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                     labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum")
            return summed / self._num_items

    def _time_stage_compute(self) -> None:
        """Wrap the stage's compute calls so the schedule's busy time can be told from waiting."""
        for name in ("forward_one_chunk", "backward_one_chunk"):
            inner = getattr(self.stage, name)

            def timed(*args, _inner=inner, **kwargs):
                with self.compute:
                    return _inner(*args, **kwargs)

            setattr(self.stage, name, timed)

    def forward_backward(self, batch, micro_index, n_micro, num_items):
        if "position_ids" in batch:  # refused at config time (pp_settings); never trained on silently
            raise FidelityError("pipeline stages take the token ids only; packed rows' position ids cannot reach them")
        self._num_items = num_items
        losses = [] if self.last else None
        start = time.perf_counter()
        with autocast(self.spec, self.ctx.device):
            args = (batch["input_ids"],) if self.first else ()
            self.schedule.step(*args, target=batch["labels"] if self.last else None, losses=losses,
                               return_outputs=False)
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)
        self._step_wall += time.perf_counter() - start
        self._step_busy += self.compute.take()
        if not self.last:
            return None
        # The pieces' shares of the step's token mean: their sum is this micro-batch's share.
        return torch.stack([l.detach() for l in losses]).sum()

    def optimizer_step(self):
        norm = super().optimizer_step()
        self._timings.append({"schedule_wall_s": self._step_wall, "stage_compute_s": self._step_busy})
        self._step_wall = self._step_busy = 0.0
        return norm

    def stage_group(self):
        return dist.group.WORLD  # each stage holds its own layers: the global norm sums over all stages

    def take_comm_seconds(self) -> None:
        return None  # point-to-point time is inside the measured idle fraction, not timed apart

    def facts_after_training(self) -> None:
        if len(self._timings) > self.spec.untimed_steps:
            self._write_bubble()

    def _write_bubble(self) -> None:
        from distlab.records.metrics import summarize

        warm = self.spec.untimed_steps
        timed = self._timings[warm:]
        idle = [1 - t["stage_compute_s"] / t["schedule_wall_s"] for t in timed if t["schedule_wall_s"] > 0]
        record = {
            "rank": dist.get_rank(), "stage": dist.get_rank(), "stages": dist.get_world_size(),
            "microbatches": self.n_pipe, "schedule": self.spec.pp["schedule"],
            "idle_fraction": summarize(idle),
            "formula_bubble": bubble_formula(dist.get_world_size(), self.n_pipe),
            "per_step": self._timings,
            "how": ("idle fraction = 1 - (time in this stage's forward_one_chunk + loss + backward_one_chunk; "
                    "CUDA: event-timed) / "
                    "wall time of schedule.step, per optimizer step after warm-up; the idle part is waiting on "
                    "neighbour stages (bubble) plus point-to-point transfer time"),
        }
        folder = run_files_dir(self.ctx.run_dir)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"pipeline-rank{dist.get_rank()}.json").write_text(json.dumps(record, indent=1))

    # -- truth --------------------------------------------------------------------------
    def describe(self) -> dict:
        out = super().describe()
        mine = {"layers": list(self.bounds[dist.get_rank()]), "embedding": self.first, "head": self.last,
                "decoder_layers_held": len(decoder_layers(self.model)),
                "weights_loaded_bytes": self.loaded_bytes}
        stages = [None] * dist.get_world_size()
        dist.all_gather_object(stages, mine)  # every rank describes, so this collective is matched
        out.update({
            "wrappers_found": ["PipelineStage"] if isinstance(self.stage, PipelineStage) else [],
            "pipeline_stages": self.stage.num_stages,
            "stage_index": self.stage.stage_index,
            "stages": stages,
            "schedule": type(self.schedule).__name__,
            "pipeline_microbatches": self.n_pipe,
            "bubble_formula": bubble_formula(self.stage.num_stages, self.n_pipe),
        })
        return out

    def verify(self, described: dict) -> None:
        super().verify(described)
        if described["pipeline_stages"] != self.spec.world_size:
            raise FidelityError(f"pipeline has {described['pipeline_stages']} stages, spec world_size "
                                f"{self.spec.world_size}")
        wanted = SCHEDULES[self.spec.pp["schedule"]].__name__
        if described["schedule"] != wanted:
            raise FidelityError(f"pipeline schedule {described['schedule']}, spec asks for {wanted}")
        held = [i for stage in described["stages"] for i in stage["layers"]]
        total = sum(len(r) for r in self.bounds)
        if sorted(held) != list(range(total)) or any(s["decoder_layers_held"] != len(s["layers"])
                                                     for s in described["stages"]):
            raise FidelityError(f"pipeline stages hold layers {[s['layers'] for s in described['stages']]}, "
                                f"not each of the {total} layers exactly once")

    # -- the whole model and checkpoints -------------------------------------------------
    collective_forward = True

    def forward_logits(self, input_ids, every_rank=False, extra=None):
        """The stages run one after another on the whole batch (no schedule: nothing to
        overlap without a backward): each sends its activations on, the last sends the logits
        to rank 0. Transfers are fp32 on the rank's device (NCCL moves device tensors only).
        every_rank is never asked of PP: its data-parallel size is 1 (ModelParallel). Neither is
        extra: rows packed as documents are refused for PP at config time (pp_settings)."""
        if extra:
            raise FidelityError("pipeline stages take the token ids only; packed rows' position ids cannot reach them")
        rank, world, device = dist.get_rank(), dist.get_world_size(), self.ctx.device
        ids = input_ids.to(device)
        was_training = self.model.training
        self.model.train(False)
        try:
            with torch.no_grad(), self.eval_context():
                if self.first:
                    out = self.stage_module(ids)
                else:
                    hidden = torch.empty(*ids.shape, self.model.config.hidden_size, device=device)
                    dist.recv(hidden, src=rank - 1)
                    out = self.stage_module(hidden)
        finally:
            self.model.train(was_training)
        if not self.last:
            dist.send(out.float().contiguous(), dst=rank + 1)
            out = None
        if world == 1:
            return out
        if self.last:
            dist.send(out.float().contiguous(), dst=0)
            return None
        if rank == 0:
            logits = torch.empty(*ids.shape, self.model.config.vocab_size, device=device)
            dist.recv(logits, src=world - 1)
            return logits
        return None

    def held_groups(self, select=None) -> list[list[tuple]]:
        """This stage's groups as (name, shape, dtype) lists: what the others must receive."""
        from distlab.runtime.streamed import parameter_groups

        params = dict(self.model.named_parameters())
        return [[(n, tuple(params[n].shape), str(params[n].dtype).removeprefix("torch.")) for n in group]
                for group in parameter_groups(self.model, select)]

    def state_groups(self, select=None):
        """Strategy.state_groups for stages: the ranks first tell each other which groups they
        hold (names, shapes, dtypes), then, in the model's order, rank 0 yields its own and
        receives every other stage's group by point-to-point transfer, one group at a time."""
        from distlab.runtime.streamed import host

        rank = dist.get_rank()
        params = dict(self.model.named_parameters())
        held = [None] * dist.get_world_size()
        dist.all_gather_object(held, self.held_groups(select))
        for owner, groups in enumerate(held):
            for group in groups:
                out = {}
                if owner == rank == 0:
                    out = {n: host(params[n]) for n, _, _ in group}
                elif rank == owner:
                    for n, _, _ in group:
                        dist.send(params[n].detach().contiguous(), dst=0)
                elif rank == 0:
                    for n, shape, dtype in group:
                        value = torch.empty(shape, dtype=getattr(torch, dtype), device=self.ctx.device)
                        dist.recv(value, src=owner)
                        out[n] = host(value)
                yield out

    def save_checkpoint(self, path: str) -> None:
        dcp_save(self, path)

    def load_checkpoint(self, path: str) -> None:
        dcp_load(self, path)


# The class distlab.strategies finds for the strategy name "pp" (its module name).
STRATEGY = PipelineParallelStrategy
