"""The one interface every strategy implements; the training loop knows nothing else.

A strategy owns: the process group, wrapping model + optimizer, one micro-batch's
forward/backward (with its gradient-sync rule), the optimizer step, checkpoint save/load,
and an honest description of what actually happened (checked against the spec).
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distlab.records.spec import Spec, SpecFields
from distlab.errors import FidelityError  # noqa: F401 (strategies and tests import it from here)
from distlab.runtime.accumulation import for_backward
from distlab.records.job import Job
from distlab.configuration.precision import autocast, dtype_name, frozen_base_dtype, parameter_dtype_mismatch


@dataclass
class RunContext:
    spec: Spec
    run_dir: str
    device: torch.device
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    job: Job | None = None  # the whole job this rank runs (None: a bare context, e.g. a test's)
    #: What is trained (a distlab.tasks Task: its module, batches and loss), found by the rank
    #: (distlab.tasks.task_for) and handed in: a strategy names no task. None: a bare context
    #: whose strategy never builds a model.
    task: object | None = None
    #: Steps left out of the timing: the spec's, or fewer for an elastic Ray group that resumed
    #: near the end (distlab.rank.ray_worker). The rank keeps one spec; this is what it times.
    untimed_steps: int | None = None

    def __post_init__(self):
        if not isinstance(self.spec, SpecFields):  # a spec read from a file by hand (a test's or benchmark's rank)
            self.spec = Spec(self.spec)
        if self.untimed_steps is None:
            self.untimed_steps = self.spec.untimed_steps or 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


class Strategy:
    """Defaults fit any data-parallel wrapper whose forward the task's loss can call."""

    name = "base"
    #: class names one of which must appear in the wrapped model's module tree
    expected_wrappers: tuple[str, ...] = ()

    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        self.spec = ctx.spec
        self.task = ctx.task  # what is trained: its module, batches and loss (distlab.tasks)
        self.model = None
        self.optimizer = None
        self.scheduler = None  # attach_scheduler(), after wrap()

    # -- process group ------------------------------------------------------------------
    def init_distributed(self) -> None:
        """Join the process group torchrun (or Ray Train) described in the environment."""
        if dist.is_initialized():  # Ray Train sets it up before calling the train function
            return
        backend = "nccl" if self.ctx.device.type == "cuda" else "gloo"
        if self.ctx.device.type == "cuda":
            torch.cuda.set_device(self.ctx.device)
        dist.init_process_group(backend=backend, device_id=self.ctx.device if backend == "nccl" else None,
                                timeout=self.collective_timeout)

    @property
    def collective_timeout(self):
        """The longest any collective of this rank waits: the job's runtime (collective_timeout)."""
        from distlab.records.job import collective_timeout

        return collective_timeout(self.ctx.job, self.spec)

    @property
    def data_parallel_rank(self) -> int:
        return dist.get_rank()

    @property
    def data_parallel_size(self) -> int:
        return dist.get_world_size()

    def data_parallel_group(self):
        """The process group of the data-parallel ranks (None: the whole world)."""
        return None

    def gradient_divisor(self, n_micro: int) -> int:
        """What the wrapper divides the summed gradients by: DDP and FSDP average over the
        data-parallel ranks (distlab.runtime.accumulation multiplies the loss by it first)."""
        return self.data_parallel_size

    # -- model --------------------------------------------------------------------------
    def load_model(self, model_source: str):
        """The model this rank starts from, before LoRA and wrap(): by default every rank
        loads the task's whole trained module (host memory) in frozen_base_dtype(spec).
        Strategies that shard or split the model override this so that no rank ever holds
        more than its part (distlab.rank.model_setup). QLoRA: the base in 4-bit NF4 on this
        rank's device (distlab.runtime.qlora; refused at config time for the strategies that
        override this, distlab.configuration.training_tools, but DeepSpeed's ZeRO 0-2)."""
        if self.spec.method == "qlora":
            return self.task.load_quantized(model_source, self.spec, self.ctx.device)
        return self.task.load_model(model_source, dtype=frozen_base_dtype(self.spec))

    def lora_context(self):
        """Context around LoRA's application to load_model's result (a meta-device model's
        strategy keeps the adapters' initial values there: distlab.strategies.fsdp)."""
        return contextlib.nullcontext()

    def build_optimizer(self, params):
        return torch.optim.AdamW(params, lr=self.spec.lr, weight_decay=self.spec.weight_decay)

    def trainable(self, model):
        return [p for p in model.parameters() if p.requires_grad]

    def wrap(self, model) -> None:
        """Set self.model and self.optimizer."""
        raise NotImplementedError

    def train_mode(self) -> dict:
        """Training mode (dropout on) on every module this rank steps, before the first step:
        from_pretrained returns a model in eval mode, so without this a model with dropout (a
        user's model, LoRA with lora_dropout > 0) would train with dropout silently off. Fails the
        run when a module stays in eval mode; returns the count for the run's record."""
        modules = list(self.training_modules())
        for module in modules:
            module.train()
        counted = [m for root in modules for m in root.modules()]
        idle = sorted({type(m).__name__ for m in counted if not m.training})
        if idle:
            raise FidelityError(f"modules still in eval mode after train(): {idle}")
        return {"modules_in_train_mode": len(counted), "how": "nn.Module.train() before the first step"}

    def training_modules(self):
        """The modules whose forward the steps run (their children included)."""
        return [self.model]

    def sync_context(self, is_last_micro: bool):
        """Context for one micro-batch's backward; data-parallel wrappers skip sync until the last."""
        return contextlib.nullcontext()

    def forward_backward(self, batch: dict, micro_index: int, n_micro: int, num_items) -> torch.Tensor:
        """One micro-batch: batch = what the task's TrainData built (causal LM: {"input_ids",
        "labels"}, [micro_batch, seq_len] each, a label of -100 not trained on); num_items: the
        step's item count over every micro-batch and data-parallel rank
        (distlab.runtime.accumulation). Returns this micro-batch's detached share of the step's
        loss (None on ranks without it)."""
        with self.sync_context(micro_index == n_micro - 1):
            with autocast(self.spec, self.ctx.device):
                share = self.task.loss(self.model, batch, num_items)
            for_backward(share, self.gradient_divisor(n_micro)).backward()
        return share.detach()

    def optimizer_step(self):
        """Clip (max_grad_norm) and step; returns the pre-clip global gradient norm (a tensor:
        the loop reads it after its timer)."""
        norm = self.clip_gradients()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    # -- fine-tuning: schedule and clipping ------------------------------------------------
    def scheduled_optimizer(self):
        """The torch optimizer whose param_groups the learning-rate schedule sets."""
        return self.optimizer

    def attach_scheduler(self) -> None:
        """The run's LR schedule (distlab.runtime.schedule), once the optimizer exists (DeepSpeed
        builds it inside wrap(), where its engine takes it)."""
        if self.scheduler is None:
            from distlab.runtime.schedule import lr_scheduler

            self.scheduler = lr_scheduler(self.spec, self.scheduled_optimizer())

    def step_scheduler(self) -> None:
        """Once per optimizer step, after it (the loop calls it for every strategy)."""
        self.scheduler.step()

    def learning_rate(self) -> float:
        """The rate the next optimizer step uses, read from the optimizer itself."""
        return float(self.scheduled_optimizer().param_groups[0]["lr"])

    def stage_group(self):
        """Process group over which ranks hold disjoint parameters (pipeline stages), else None."""
        return None

    def clip_gradients(self):
        """Pre-clip global norm of this step's gradients, clipped to max_grad_norm when > 0
        (distlab.runtime.clipping: plain tensors, DTensor shards and pipeline stages alike)."""
        from distlab.runtime.clipping import clip_to

        return clip_to(self.trainable(self.model), self.spec.max_grad_norm, self.stage_group())

    def take_comm_seconds(self) -> float | None:
        """Collective time since the last call, or None where this strategy does not
        measure it (recorded as 'not measured', never as 0)."""
        return None

    def facts_after_training(self) -> dict | None:
        """Once on every rank after the last step, outside any timer: what the strategy
        measured across the whole run. Returned keys are merged into the run's `as_built`
        record (rank 0's); a strategy may also write side files (the pipeline bubble)."""
        return None

    def unwrapped(self):
        """The plain Hugging Face module (for saving, evaluation, counting)."""
        return self.model

    def evaluate(self, ids, labels, positions=None) -> dict | None:
        """Collective: held-out loss of the model as trained so far (eval_every), on rank 0
        (None elsewhere): forward_logits on the model as it is held (distlab.runtime.evaluation)."""
        from distlab.runtime.evaluation import evaluate_forward

        return evaluate_forward(self, ids, labels, positions)

    # -- truth --------------------------------------------------------------------------
    def state_bytes(self) -> dict:
        from distlab.records.metrics import model_state_bytes

        return model_state_bytes(self.model, self.optimizer)

    def describe(self) -> dict:
        names = sorted({type(m).__name__ for m in self.model.modules()} | {type(self.model).__name__})
        out = {
            "strategy": self.name,
            "outer_wrapper": type(self.model).__name__,
            "wrappers_found": [n for n in names if n in self.expected_wrappers],
            "world_size": dist.get_world_size(),
            "backend": dist.get_backend(),
            "data_parallel_size": self.data_parallel_size,
            "device": str(self.ctx.device),
            # Read from the tensors, not from the spec: where each parameter's storage lives
            # and in what form (DTensor shard, DeepSpeed ZeRO-3 partition, plain tensor).
            **parameter_facts(self.model),
            "optimizer_master_dtypes": optimizer_dtypes(self.optimizer),
        }
        if isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            # Read from the wrapper: on, DDP walks the autograd graph every step to find parameters
            # that got no gradient (a cost, and a sign of a model part the loss skips).
            out["find_unused_parameters"] = self.model.find_unused_parameters
        return out

    def verify(self, described: dict) -> None:
        """Fail the run when what happened differs from the spec."""
        spec = self.spec
        if described["world_size"] != spec.world_size:
            raise FidelityError(f"spec world_size {spec.world_size} but the process group has "
                                f"{described['world_size']} ranks")
        if self.expected_wrappers and not described["wrappers_found"]:
            raise FidelityError(f"strategy {self.name} expected one of {self.expected_wrappers} to wrap the model; "
                                f"found outer wrapper {described['outer_wrapper']}")
        if described["device"].split(":")[0] != spec.device:
            raise FidelityError(f"spec device {spec.device} but the model is on {described['device']}")
        if "parameter_dtypes" in described:
            problem = parameter_dtype_mismatch(spec.precision, described["parameter_dtypes"],
                                               described.get("optimizer_master_dtypes"), spec.method)
            if problem:
                raise FidelityError(problem)
        if described.get("activation_checkpointing"):
            from distlab.runtime.activations import check_checkpointing

            problem = check_checkpointing(described["activation_checkpointing"], spec)
            if problem:
                raise FidelityError(problem)
        if "parameter_devices" not in described:
            return
        allowed = {spec.device} | ({"cpu"} if offloads_parameters(spec) else set())
        stray = sorted(set(described["parameter_devices"]) - allowed)
        if stray:
            raise FidelityError(f"spec device {spec.device} but parameters live on {stray} "
                                f"({described['parameter_devices']})")
        layout = expected_layout(spec)
        if layout and not described["parameter_layout"].get(layout):
            raise FidelityError(f"strategy {spec.strategy} should hold its parameters as {layout}, but the model "
                                f"holds {described['parameter_layout']} (outer wrapper {described['outer_wrapper']})")

    # -- the trained model, whole: evaluation, export, recorded logits -----------------
    #: True where every rank must take part in a forward (sharded or split parameters)
    collective_forward = False

    def eval_context(self):
        """The precision context of an evaluation forward: training's autocast by default."""
        return autocast(self.spec, self.ctx.device)

    def forward_logits(self, input_ids: torch.Tensor, every_rank: bool = False,
                       extra: dict | None = None) -> torch.Tensor | None:
        """Collective: logits of the model as it trains (still sharded, on this rank's device,
        training precision, eval mode, no grad) on rank 0; None elsewhere. Strategies whose
        ranks each hold the whole model run it on rank 0 alone. every_rank: each data-parallel
        rank passes its own batch and gets its own logits (distlab.runtime.evaluation.evaluate_forward).
        extra: further forward arguments (packed rows' position ids)."""
        if not self.collective_forward and dist.get_rank() != 0 and not every_rank:
            return None
        module = self.model if self.collective_forward else self.unwrapped()
        was_training = module.training
        module.train(False)
        try:
            with torch.no_grad(), self.eval_context():
                logits = module(input_ids=input_ids.to(self.ctx.device), **(extra or {})).logits
        finally:
            module.train(was_training)
        return logits if every_rank or dist.get_rank() == 0 else None

    def state_groups(self, select=None):
        """Collective generator over the trained parameters, one group at a time (a decoder
        layer, or one other parameter: distlab.runtime.streamed.parameter_groups): {name: host (CPU)
        tensor} on rank 0, {} on the others, names as in unwrapped().named_parameters() (peft
        names for LoRA); select(name) keeps some. A DTensor (FSDP2, tensor parallel) is gathered
        whole on every rank one parameter at a time (full_tensor), its shard first moved to the
        collective's device when it was offloaded to the CPU. Every rank iterates to the end."""
        from distlab.runtime.streamed import host, parameter_groups

        module = self.unwrapped()
        params = dict(module.named_parameters())
        main = dist.get_rank() == 0
        for names in parameter_groups(module, select):
            group = {}
            for name in names:
                value = gathered(params[name], self.ctx.device)
                if main:
                    group[name] = host(value)
                del value
            yield group

    def whole_state(self) -> dict:
        """Collective: every parameter gathered whole, {name: host copy} on rank 0, {} elsewhere,
        built from state_groups one group at a time. Only for models one process may hold whole
        (a diffusion UNet, tests); the causal LM streams its state instead."""
        return {name: value.clone() for group in self.state_groups() for name, value in group.items()}

    # -- checkpoints --------------------------------------------------------------------
    # Both are collective: every rank calls them. distlab/checkpoints/checkpoint.py wraps them (atomic
    # folder, manifest, trainer state, export); distlab/jobs/validate.py checks them.
    def save_checkpoint(self, path: str) -> None:
        """Write the native format under `path`: the trainable parameters (LoRA: the adapters
        only; the frozen base is named by identity in distlab_checkpoint.json), the optimizer
        and any scheduler state.
        Only safetensors, JSON or tensors torch.load(weights_only=True) can read. RNG, step and
        data position are saved by distlab.checkpoints.checkpoint, not here."""
        raise NotImplementedError(f"{self.name} has no checkpoint save yet")

    def load_checkpoint(self, path: str) -> None:
        """Load what save_checkpoint wrote into the wrapped model and optimizer. Validation also
        calls it at another world size (2 -> 1, 1 -> 2): a format that cannot load there must
        raise NotImplementedError saying why (recorded 'unsupported'); any other exception is
        recorded as a failed check."""
        raise NotImplementedError(f"{self.name} has no checkpoint load yet")


def gathered(param, device: torch.device):
    """The whole value of a parameter: a DTensor's full_tensor() (collective on its mesh), its
    local shard first moved to `device` when it lives elsewhere (FSDP's CPUOffloadPolicy keeps
    shards in host memory; NCCL gathers device tensors only); any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return param
    local = param.to_local()
    if local.device != device:
        param = DTensor.from_local(local.to(device), param.device_mesh, param.placements, run_check=False,
                                   shape=param.shape, stride=param.stride())
    return param.full_tensor()


def _storage(param):
    """The tensor that really holds a parameter's values on this rank."""
    partition = getattr(param, "ds_tensor", None)  # DeepSpeed ZeRO-3: the rank's partition
    if partition is not None:
        return partition, "deepspeed_partition"
    to_local = getattr(param, "to_local", None)  # DTensor (FSDP2, tensor parallel): the local shard
    if callable(to_local):
        return to_local(), "dtensor"
    return param, "plain"


def parameter_facts(model) -> dict:
    """Where each parameter's storage lives, in what form, and in what dtype: elements per dtype
    that this rank holds (its ZeRO-3 partition or DTensor shard, else the whole tensor)."""
    devices, layout, dtypes = {}, {}, {}
    for param in model.parameters():
        tensor, kind = _storage(param)
        devices[tensor.device.type] = devices.get(tensor.device.type, 0) + 1
        layout[kind] = layout.get(kind, 0) + 1
        name = dtype_name(tensor.dtype)
        dtypes[name] = dtypes.get(name, 0) + tensor.numel()
    return {"parameter_devices": devices, "parameter_layout": layout, "parameter_dtypes": dtypes}


def optimizer_dtypes(optimizer) -> dict | None:
    """Elements per dtype of the tensors the optimizer steps (its masters: DeepSpeed's fp32
    partitions, a plain optimizer's parameters); None without an optimizer."""
    if optimizer is None:
        return None
    # ZeRO-3 hands its fp32 partitions to the inner optimizer's param_groups only around a step;
    # between steps they are its own flat groups.
    masters = getattr(optimizer, "fp32_partitioned_groups_flat", None)
    if masters is None:
        masters = [param for group in optimizer.param_groups for param in group["params"]]
    dtypes = {}
    for param in masters:
        tensor = _storage(param)[0]
        name = dtype_name(tensor.dtype)
        dtypes[name] = dtypes.get(name, 0) + tensor.numel()
    return dtypes


def offloads_parameters(spec: Spec) -> bool:
    """Specs whose parameters may legitimately sit in host memory on a CUDA run (the strategy's settings)."""
    from distlab.configuration.strategies.settings import settings_for

    return settings_for(spec).offloads_parameters(spec)


def expected_layout(spec: Spec) -> str | None:
    """The parameter form a sharding strategy must leave behind (None: plain tensors are right;
    the strategy's settings say)."""
    from distlab.configuration.strategies.settings import settings_for

    return settings_for(spec).parameter_layout(spec)


class ModelParallel:
    """Mixin for model-parallel strategies (TP, PP): the ranks split the model, not the data,
    so every rank reads the whole batch (data-parallel size 1, rank 0 for the sampler)."""

    @property
    def data_parallel_rank(self) -> int:
        return 0

    @property
    def data_parallel_size(self) -> int:
        return 1


def local_device(spec: Spec) -> torch.device:
    """cuda:<LOCAL_RANK> or cpu, exactly as the spec says: never a silent fallback."""
    if spec.device == "cuda":
        if not torch.cuda.is_available():
            raise FidelityError("spec device cuda but torch.cuda.is_available() is False")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")
