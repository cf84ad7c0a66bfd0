"""Pipeline parallel with torch.distributed.pipelining: rank r holds a contiguous run of
decoder layers (the embedding on the first stage, final norm and LM head on the last);
activations travel rank to rank by point-to-point sends.

A stage is the model's own forward with the other stages' layers replaced by pass-throughs
(StageModule): masks (sliding window, per-layer attention types), rotary embeddings and norms
are the model's code, not a re-implementation. Which children run before and after the
layers comes from the model's `base_model_pp_plan`; families without one, or with tied
embeddings, are refused at config time (distlab.families). Each rank builds the model on the
meta device and reads from the safetensors only the weights of its stage
(distlab.partial_load): no rank ever holds the whole model.

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
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from distlab.model import decoder_layers
from distlab.partial_load import empty_model, load_held_weights
from distlab.run_layout import run_files_dir
from distlab.strategies.base import FidelityError, ModelParallel, Strategy, autocast

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def split_layers(n_layers: int, n_stages: int) -> list[range]:
    """Contiguous runs of layers, sizes differing by at most one (earlier stages get more)."""
    if n_stages > n_layers:
        raise ValueError(f"a pipeline of {n_stages} stages needs at least {n_stages} decoder layers; "
                         f"the model has {n_layers}")
    base, extra = divmod(n_layers, n_stages)
    bounds, start = [], 0
    for stage in range(n_stages):
        size = base + (1 if stage < extra else 0)
        bounds.append(range(start, start + size))
        start += size
    return bounds


def bubble_formula(stages: int, microbatches: int) -> float:
    """GPipe / 1F1B idle fraction with equal stage times (Huang et al. 2019; Narayanan et al. 2021)."""
    return (stages - 1) / (microbatches + stages - 1)


class PassThrough(nn.Module):
    """Stands in for a decoder layer another stage holds: the list keeps its length, so the
    model's forward still sees layer i at index i (per-layer attention types are indexed)."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


class StageModule(nn.Module):
    """This rank's slice of a Hugging Face causal LM, run through the model's own forward.

    Every stage calls the base model's forward (the full causal LM's on the last stage, so the
    head and any logit soft-capping are the model's own): the masks it builds (causal, sliding
    window, per-layer types), its rotary embeddings and its final norm are exactly those of the
    plain model. Layers of other stages are PassThrough. A later stage passes the activations it
    received as `inputs_embeds` (only their shape, dtype and device shape the masks and rotary
    tables) and a pre-hook on its first own layer hands them to that layer unchanged, so
    whatever the preamble does to embeddings (scaling, dropout) happens once, on stage 0.
    """

    def __init__(self, model, first_layer: nn.Module, first: bool, last: bool):
        super().__init__()
        self.hf = model
        self.first, self.last = first, last
        self._incoming = None
        if not first:
            first_layer.register_forward_pre_hook(self._hand_over, with_kwargs=True)

    def _hand_over(self, _module, args, kwargs):
        if args:
            return (self._incoming, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": self._incoming}

    def forward(self, x):
        inputs = {"input_ids": x} if self.first else {"inputs_embeds": x}
        self._incoming = None if self.first else x
        if self.last:
            return self.hf(**inputs, use_cache=False).logits
        return self.hf.base_model(**inputs, use_cache=False).last_hidden_state


def prune_to_stage(model, keep: range, first: bool, last: bool) -> nn.Module:
    """Drop what other stages own, keeping Hugging Face parameter names for what stays; returns
    this stage's first decoder layer. What runs before and after the layers comes from the
    model's own pipeline plan (config.base_model_pp_plan, see distlab.families)."""
    from distlab.families import pp_pieces

    if model.config.tie_word_embeddings and not (first and last):
        raise NotImplementedError("pipeline parallel with tied input/output embeddings would put one weight on "
                                  "two stages; use a model with tie_word_embeddings false")
    pieces = pp_pieces(model.config)
    if pieces is None:
        raise NotImplementedError(f"pipeline parallel: {type(model).__name__} declares no base_model_pp_plan")
    before, layers_name, after = pieces
    base = model.base_model
    layers = getattr(base, layers_name)
    for index in range(len(layers)):
        if index not in keep:
            layers[index] = PassThrough()
    if not first:
        embed = model.get_input_embeddings()
        for name in before:
            child = getattr(base, name)
            if child is embed:
                setattr(base, name, None)  # never called: later stages pass inputs_embeds
            elif any(True for _ in child.parameters()):
                raise NotImplementedError(f"pipeline parallel: '{name}' of {type(base).__name__} has weights and "
                                          "runs before the decoder layers; only the first stage could hold it")
    if not last:
        for name in after:
            setattr(base, name, nn.Identity())  # the final norm belongs to the last stage
        head = model.get_output_embeddings()
        for name, child in model.named_children():
            if child is head:
                setattr(model, name, None)
    return layers[keep.start]


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

    def load_model(self, model_source: str):
        """A meta-device skeleton: wrap() keeps this stage's part and loads only its weights."""
        return empty_model(model_source)

    def wrap(self, model) -> None:
        if self.spec["method"] != "full":
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
        self.n_pipe = self.spec["pp"]["microbatches"]
        self.stage = PipelineStage(self.stage_module, rank, world, self.ctx.device)
        # scale_grads=False: the loss below is already divided by every micro-batch count, so
        # gradients accumulated over the loop's micro-batches are not rescaled twice.
        self.schedule = SCHEDULES[self.spec["pp"]["schedule"]](self.stage, self.n_pipe, loss_fn=self._loss,
                                                               scale_grads=False)
        self.optimizer = self.build_optimizer(self.trainable(model))
        self._n_micro = 1
        self.compute = ComputeTimer(self.ctx.device)
        self._timings: list[dict] = []
        self._step_wall = self._step_busy = 0.0
        self._time_stage_compute()

    def _loss(self, logits, labels):
        with self.compute:
            shifted = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                      labels[:, 1:].reshape(-1))
            return shifted / (self.n_pipe * self._n_micro)

    def _time_stage_compute(self) -> None:
        """Wrap the stage's compute calls so the schedule's busy time can be told from waiting."""
        for name in ("forward_one_chunk", "backward_one_chunk"):
            inner = getattr(self.stage, name)

            def timed(*args, _inner=inner, **kwargs):
                with self.compute:
                    return _inner(*args, **kwargs)

            setattr(self.stage, name, timed)

    def forward_backward(self, batch, micro_index, n_micro):
        self._n_micro = n_micro
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
        # Undo the scaling that made the gradients right: report the plain mean loss.
        return (torch.stack([l.detach() for l in losses]).mean() * self.n_pipe * n_micro)

    def optimizer_step(self) -> None:
        super().optimizer_step()
        self._timings.append({"schedule_wall_s": self._step_wall, "stage_compute_s": self._step_busy})
        self._step_wall = self._step_busy = 0.0

    def take_comm_seconds(self) -> None:
        return None  # point-to-point time is inside the measured idle fraction, not timed apart

    def facts_after_training(self) -> None:
        if len(self._timings) > self.spec["warmup_steps"]:
            self._write_bubble()

    def _write_bubble(self) -> None:
        from distlab.metrics import summarize

        warm = self.spec["warmup_steps"]
        timed = self._timings[warm:]
        idle = [1 - t["stage_compute_s"] / t["schedule_wall_s"] for t in timed if t["schedule_wall_s"] > 0]
        record = {
            "rank": dist.get_rank(), "stage": dist.get_rank(), "stages": dist.get_world_size(),
            "microbatches": self.n_pipe, "schedule": self.spec["pp"]["schedule"],
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
        if described["pipeline_stages"] != self.spec["world_size"]:
            raise FidelityError(f"pipeline has {described['pipeline_stages']} stages, spec world_size "
                                f"{self.spec['world_size']}")
        wanted = SCHEDULES[self.spec["pp"]["schedule"]].__name__
        if described["schedule"] != wanted:
            raise FidelityError(f"pipeline schedule {described['schedule']}, spec asks for {wanted}")
        held = [i for stage in described["stages"] for i in stage["layers"]]
        total = sum(len(r) for r in self.bounds)
        if sorted(held) != list(range(total)) or any(s["decoder_layers_held"] != len(s["layers"])
                                                     for s in described["stages"]):
            raise FidelityError(f"pipeline stages hold layers {[s['layers'] for s in described['stages']]}, "
                                f"not each of the {total} layers exactly once")

    # -- checkpoints --------------------------------------------------------------------
    def full_state_dict(self) -> dict | None:
        mine = {name: value.detach().cpu() for name, value in self.model.state_dict().items()}
        parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, parts, dst=0)
        if dist.get_rank() != 0:
            return None
        merged = {}
        for part in parts:
            merged.update(part)
        return merged

    def save_checkpoint(self, path: str) -> None:
        from distlab.strategies.fsdp import dcp_save

        dcp_save(self, path)

    def load_checkpoint(self, path: str) -> None:
        from distlab.strategies.fsdp import dcp_load

        dcp_load(self, path)
