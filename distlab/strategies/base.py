"""The one interface every strategy implements; the training loop knows nothing else.

A strategy owns: the process group, wrapping model + optimizer, one micro-batch's
forward/backward (with its gradient-sync rule), the optimizer step, checkpoint save/load,
and an honest description of what actually happened (checked against the spec).
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


class FidelityError(RuntimeError):
    """The run is not what its spec says (wrong wrapper, world size, device)."""


@dataclass
class RunContext:
    spec: dict
    run_dir: str
    device: torch.device
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    job: dict = field(default_factory=dict)  # the whole job.json this rank runs

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def autocast(spec: dict, device: torch.device):
    if spec["precision"] == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if spec["precision"] == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def frozen_base_dtype(spec: dict):
    """The dtype whole-model strategies (DDP, Accelerate) load weights in: LoRA's frozen base
    in bf16 when precision is bf16 (it is never stepped, autocast computes in bf16 anyway;
    peft keeps the adapters in fp32), else fp32 (full fine-tuning: the weights are the
    optimizer's fp32 masters under autocast). distlab.advisor counts the same bytes."""
    if spec.get("method") == "lora" and spec.get("precision") == "bf16":
        return torch.bfloat16
    return torch.float32


class Strategy:
    """Defaults fit any data-parallel wrapper whose forward returns a HF output with .loss."""

    name = "base"
    #: class names one of which must appear in the wrapped model's module tree
    expected_wrappers: tuple[str, ...] = ()

    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        self.spec = ctx.spec
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
        dist.init_process_group(backend=backend, device_id=self.ctx.device if backend == "nccl" else None)

    @property
    def data_parallel_rank(self) -> int:
        return dist.get_rank()

    @property
    def data_parallel_size(self) -> int:
        return dist.get_world_size()

    # -- model --------------------------------------------------------------------------
    def load_model(self, model_source: str):
        """The model this rank starts from, before LoRA and wrap(): by default every rank
        loads the whole model (host memory) in frozen_base_dtype(spec). Strategies that shard
        or split the model override this so that no rank ever holds more than its part
        (distlab.model_setup)."""
        from distlab.model import load_model

        return load_model(model_source, dtype=frozen_base_dtype(self.spec))

    def lora_context(self):
        """Context around LoRA's application to load_model's result (a meta-device model's
        strategy keeps the adapters' initial values there: distlab.strategies.fsdp)."""
        return contextlib.nullcontext()

    def build_optimizer(self, params):
        return torch.optim.AdamW(params, lr=self.spec["lr"], weight_decay=self.spec["weight_decay"])

    def trainable(self, model):
        return [p for p in model.parameters() if p.requires_grad]

    def wrap(self, model) -> None:
        """Set self.model and self.optimizer."""
        raise NotImplementedError

    def sync_context(self, is_last_micro: bool):
        """Context for one micro-batch's backward; data-parallel wrappers skip sync until the last."""
        return contextlib.nullcontext()

    def forward_backward(self, batch: dict, micro_index: int, n_micro: int) -> torch.Tensor:
        """One micro-batch: batch = {"input_ids", "labels"} ([micro_batch, seq_len] each; a
        label of -100 is not trained on). Returns the detached loss (None on ranks without it)."""
        with self.sync_context(micro_index == n_micro - 1):
            with autocast(self.spec, self.ctx.device):
                loss = self.model(**batch).loss
            (loss / n_micro).backward()
        return loss.detach()

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
        """The run's LR schedule (distlab.schedule), once the optimizer exists (DeepSpeed
        builds it inside wrap(), where its engine takes it)."""
        if self.scheduler is None:
            from distlab.schedule import lr_scheduler

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
        (distlab.clipping: plain tensors, DTensor shards and pipeline stages alike)."""
        from distlab.clipping import clip_to

        return clip_to(self.trainable(self.model), self.spec["max_grad_norm"], self.stage_group())

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

    def evaluate(self, ids, labels) -> dict | None:
        """Collective: held-out loss of the model as trained so far (eval_every), on rank 0 at
        least. Every rank runs the whole forward of its wrapped model (distlab.evaluation)."""
        from distlab.evaluation import evaluate_in_place

        return evaluate_in_place(self, ids, labels)

    # -- truth --------------------------------------------------------------------------
    def state_bytes(self) -> dict:
        from distlab.metrics import model_state_bytes

        return model_state_bytes(self.model, self.optimizer)

    def describe(self) -> dict:
        names = sorted({type(m).__name__ for m in self.model.modules()} | {type(self.model).__name__})
        return {
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
        }

    def verify(self, described: dict) -> None:
        """Fail the run when what happened differs from the spec."""
        spec = self.spec
        if described["world_size"] != spec["world_size"]:
            raise FidelityError(f"spec world_size {spec['world_size']} but the process group has "
                                f"{described['world_size']} ranks")
        if self.expected_wrappers and not described["wrappers_found"]:
            raise FidelityError(f"strategy {self.name} expected one of {self.expected_wrappers} to wrap the model; "
                                f"found outer wrapper {described['outer_wrapper']}")
        if described["device"].split(":")[0] != spec["device"]:
            raise FidelityError(f"spec device {spec['device']} but the model is on {described['device']}")
        if described.get("activation_checkpointing"):
            from distlab.activations import check_checkpointing

            problem = check_checkpointing(described["activation_checkpointing"], spec)
            if problem:
                raise FidelityError(problem)
        if "parameter_devices" not in described:
            return
        allowed = {spec["device"]} | ({"cpu"} if offloads_parameters(spec) else set())
        stray = sorted(set(described["parameter_devices"]) - allowed)
        if stray:
            raise FidelityError(f"spec device {spec['device']} but parameters live on {stray} "
                                f"({described['parameter_devices']})")
        layout = expected_layout(spec)
        if layout and not described["parameter_layout"].get(layout):
            raise FidelityError(f"strategy {spec['strategy']} should hold its parameters as {layout}, but the model "
                                f"holds {described['parameter_layout']} (outer wrapper {described['outer_wrapper']})")

    # -- checkpoints --------------------------------------------------------------------
    # All three are collective: every rank calls them. distlab/checkpoint.py wraps them
    # (atomic folder, manifest, trainer state, export); distlab/validate.py checks them.
    def full_state_dict(self) -> dict | None:
        """The whole unsharded model state on rank 0, None elsewhere, keyed exactly like
        unwrapped().state_dict() (peft names for LoRA): the Hugging Face export, the reload
        logits and the LoRA base-weight check are computed from it."""
        return self.unwrapped().state_dict() if dist.get_rank() == 0 else None

    def save_checkpoint(self, path: str) -> None:
        """Write the native format (model, optimizer and any scheduler state) under `path`.
        Only safetensors, JSON or tensors torch.load(weights_only=True) can read. RNG, step and
        data position are saved by distlab.checkpoint, not here."""
        raise NotImplementedError(f"{self.name} has no checkpoint save yet")

    def load_checkpoint(self, path: str) -> None:
        """Load what save_checkpoint wrote into the wrapped model and optimizer. Validation also
        calls it at another world size (2 -> 1, 1 -> 2): a format that cannot load there must
        raise NotImplementedError saying why (recorded 'unsupported'); any other exception is
        recorded as a failed check."""
        raise NotImplementedError(f"{self.name} has no checkpoint load yet")


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
    devices, layout = {}, {}
    for param in model.parameters():
        tensor, kind = _storage(param)
        devices[tensor.device.type] = devices.get(tensor.device.type, 0) + 1
        layout[kind] = layout.get(kind, 0) + 1
    return {"parameter_devices": devices, "parameter_layout": layout}


def offloads_parameters(spec: dict) -> bool:
    """Specs whose parameters may legitimately sit in host memory on a CUDA run."""
    return bool(spec.get("fsdp", {}).get("cpu_offload") and spec["strategy"] == "fsdp") or (
        spec["strategy"] == "deepspeed" and spec.get("deepspeed", {}).get("offload_param", "none") != "none")


def expected_layout(spec: dict) -> str | None:
    """The parameter form a sharding strategy must leave behind (None: plain tensors are right)."""
    native_fsdp = spec["strategy"] == "fsdp" and spec.get("fsdp", {}).get("via", "native") == "native"
    if native_fsdp or spec["strategy"] == "tp":
        return "dtensor"
    if spec["strategy"] == "deepspeed" and spec.get("deepspeed", {}).get("zero_stage") == 3:
        return "deepspeed_partition"
    return None


class ModelParallel:
    """Mixin for model-parallel strategies (TP, PP): the ranks split the model, not the data,
    so every rank reads the whole batch (data-parallel size 1, rank 0 for the sampler)."""

    @property
    def data_parallel_rank(self) -> int:
        return 0

    @property
    def data_parallel_size(self) -> int:
        return 1


def local_device(spec: dict) -> torch.device:
    """cuda:<LOCAL_RANK> or cpu, exactly as the spec says: never a silent fallback."""
    if spec["device"] == "cuda":
        if not torch.cuda.is_available():
            raise FidelityError("spec device cuda but torch.cuda.is_available() is False")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")
