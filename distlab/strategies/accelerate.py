"""Hugging Face Accelerate: one Accelerator prepares model + optimizer, gradient
accumulation goes through accelerator.accumulate / accelerator.backward, checkpoints
through save_state / load_state.

It also runs FSDP requested through Accelerate (spec strategy fsdp, fsdp.via accelerate):
Accelerate's FSDP2 plugin, a CUDA path (on CPU Accelerate wraps DDP instead, so the config
refuses it there).

Accelerate decides on its own what it is doing (distributed type, process count, wrapper);
describe() records what it decided and verify() fails the run when that is not the
experiment: on CPU, an Accelerator made without cpu=True under a multi-rank launch sees
itself alone (DistributedType.NO) and trains unsynchronised.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
import torch.distributed as dist

from distlab.records.spec import Spec
from distlab.configuration.precision import ACCELERATE_MIXED_PRECISION
from distlab.runtime.accumulation import for_backward
from distlab.records.run_layout import RUN_FILES, run_files_dir
from distlab.configuration.strategies.accelerate_settings import CONFIG_NAME, uses_accelerate_fsdp
from distlab.strategies.base import FidelityError, Strategy


def expected_distributed_types(spec: Spec) -> set[str]:
    """What Accelerate must report for this experiment to be what its label says."""
    if uses_accelerate_fsdp(spec):
        return {"FSDP"}
    multi = "MULTI_CPU" if spec.device == "cpu" else "MULTI_GPU"
    # One process: `accelerate launch` starts it bare (NO); torchrun's one rank reads as MULTI_*.
    return {multi} if spec.world_size > 1 else {"NO", multi}


class AccelerateStrategy(Strategy):
    name = "accelerate"

    def __init__(self, ctx):
        super().__init__(ctx)
        self.fsdp = uses_accelerate_fsdp(self.spec)
        self.accelerator = None
        self.hook = None
        # Counted as they happen; facts_after_training() reports the final counts.
        self.counts = {"micro_batches": 0, "gradient_syncs": 0, "optimizer_steps_taken": 0,
                       "optimizer_steps_skipped": 0, "allreduce_calls": 0}

    # -- process group ------------------------------------------------------------------
    def init_distributed(self) -> None:
        from accelerate import Accelerator
        from accelerate.utils import GradientAccumulationPlugin, InitProcessGroupKwargs

        if self.ctx.device.type == "cuda":
            torch.cuda.set_device(self.ctx.device)
        accumulation = GradientAccumulationPlugin(num_steps=self.spec.grad_accum, sync_with_dataloader=False)
        kwargs = {}
        if self.fsdp:
            kwargs["fsdp_plugin"] = self._fsdp_plugin()
        # cpu=True is what makes Accelerate join the launcher's CPU ranks (see module doc).
        self.accelerator = Accelerator(cpu=self.ctx.device.type == "cpu",
                                       mixed_precision=ACCELERATE_MIXED_PRECISION[self.spec.precision],
                                       gradient_accumulation_plugin=accumulation,
                                       kwargs_handlers=[InitProcessGroupKwargs(timeout=self.collective_timeout)],
                                       **kwargs)
        launched = int(os.environ.get("WORLD_SIZE", 1))
        if self.accelerator.num_processes != launched:
            raise FidelityError(f"the launcher started {launched} ranks but Accelerate sees "
                                f"{self.accelerator.num_processes} process(es) "
                                f"({self.accelerator.distributed_type}); ranks would train unsynchronised")
        if not dist.is_initialized():
            # A bare single process (DistributedType.NO) has no process group; the loop
            # gathers its records through one, so this rank forms a group of one.
            backend = "nccl" if self.ctx.device.type == "cuda" else "gloo"
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=self.collective_timeout)

    def _fsdp_plugin(self):
        from accelerate.utils import FullyShardedDataParallelPlugin

        fsdp = self.spec.fsdp
        # transformer_cls_names_to_wrap is filled in wrap(), from the loaded model.
        return FullyShardedDataParallelPlugin(
            fsdp_version=2, reshard_after_forward=bool(fsdp["reshard_after_forward"]),
            cpu_offload=bool(fsdp["cpu_offload"]), auto_wrap_policy="transformer_based_wrap",
            state_dict_type="SHARDED_STATE_DICT", cpu_ram_efficient_loading=False)

    # -- model --------------------------------------------------------------------------
    def wrap(self, model) -> None:
        if self.fsdp:
            from distlab.runtime.model import decoder_layer_class

            plugin = self.accelerator.state.fsdp_plugin
            plugin.transformer_cls_names_to_wrap = [decoder_layer_class(model).__name__]
        optimizer = self.build_optimizer(self.trainable(model))
        # One prepare call for both: FSDP2 swaps the optimizer's parameters for shards.
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        self.optimizer.optimizer.register_step_post_hook(self._count_step)
        self.accelerator.register_save_state_pre_hook(self._drop_frozen)
        if isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            from distlab.strategies.ddp import CommTimer, timed_allreduce_hook

            self.hook = CommTimer()
            self.model.register_comm_hook(state=self.hook, hook=timed_allreduce_hook)

    def _count_step(self, optimizer, args, kwargs) -> None:
        self.counts["optimizer_steps_taken"] += 1

    def gradient_divisor(self, n_micro: int) -> int:
        # accelerator.backward divides the loss by gradient_accumulation_steps, and the DDP (or
        # FSDP) it prepared averages over the processes.
        return self.data_parallel_size * n_micro

    def forward_backward(self, batch: dict, micro_index: int, n_micro: int, num_items) -> torch.Tensor:
        accelerator = self.accelerator
        if n_micro != accelerator.gradient_accumulation_steps:
            raise FidelityError(f"the loop accumulates {n_micro} micro-batches per step, Accelerate "
                                f"{accelerator.gradient_accumulation_steps}")
        with accelerator.accumulate(self.model):
            # Accelerate counts micro-batches itself; it must agree with the loop on which
            # one ends the step, or gradients would sync (and the optimizer step) off-beat.
            if accelerator.sync_gradients != (micro_index == n_micro - 1):
                raise FidelityError(f"Accelerate's sync_gradients is {accelerator.sync_gradients} on "
                                    f"micro-batch {micro_index + 1} of {n_micro}")
            share = self.task.loss(self.model, batch, num_items)
            accelerator.backward(for_backward(share, self.gradient_divisor(n_micro)))
        self.counts["micro_batches"] += 1
        self.counts["gradient_syncs"] += int(accelerator.sync_gradients)
        return share.detach()

    def clip_gradients(self):
        """accelerator.clip_grad_norm_ (unscales fp16 gradients first; FSDP-aware) when clipping;
        the same global norm measured without it when max_grad_norm is 0."""
        if self.spec.max_grad_norm > 0:
            return self.accelerator.clip_grad_norm_(self.trainable(self.model), self.spec.max_grad_norm)
        return super().clip_gradients()

    def scheduled_optimizer(self):
        return self.optimizer.optimizer  # the torch optimizer inside AcceleratedOptimizer

    def optimizer_step(self):
        before = self.counts["optimizer_steps_taken"]
        norm = self.clip_gradients()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.counts["optimizer_steps_taken"] == before:
            if not self.optimizer.step_was_skipped:
                raise FidelityError("the loop ended a step but Accelerate did not step the optimizer")
            self.counts["optimizer_steps_skipped"] += 1  # fp16 loss scaler found inf/nan grads
        return norm

    #: why take_comm_seconds is None (the worker records it as the comm figure's reason)
    comm_unmeasured_reason = ("FSDP through Accelerate: its all-gathers and reduce-scatters run inside "
                              "fully_shard's hooks, which distlab does not time")

    def take_comm_seconds(self) -> float | None:
        if self.hook is None:
            # One process has no collective to time; under FSDP they exist but are not timed.
            return 0.0 if self.ctx.world_size == 1 and not self.fsdp else None
        self.counts["allreduce_calls"] = self.hook.buckets
        value, self.hook.seconds = self.hook.seconds, 0.0
        return value

    def unwrapped(self):
        """The Hugging Face module under Accelerate's wrapper: the PeftModel for LoRA runs."""
        return self.accelerator.unwrap_model(self.model)

    # -- truth --------------------------------------------------------------------------
    def state_bytes(self) -> dict:
        from distlab.records.metrics import model_state_bytes

        return model_state_bytes(self.model, self.optimizer.optimizer)

    def wrapper(self) -> str:
        """What actually wraps the model, found by type, not by label."""
        from torch.distributed.fsdp import FSDPModule

        if any(isinstance(m, FSDPModule) for m in self.model.modules()):
            return "FSDPModule (fully_shard)"
        if isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            return "DistributedDataParallel"
        return "none"

    def describe(self) -> dict:
        from torch.distributed.fsdp import FSDPModule

        accelerator = self.accelerator
        described = super().describe()
        described["strategy"] = "fsdp-via-accelerate" if self.fsdp else self.name
        described["wrapped_by"] = self.wrapper()
        described["wrappers_found"] = [described["wrapped_by"]] if described["wrapped_by"] != "none" else []
        described["accelerate"] = {
            "distributed_type": accelerator.distributed_type.value,
            "num_processes": accelerator.num_processes,
            "process_index": accelerator.process_index,
            "device": str(accelerator.device),
            "mixed_precision": accelerator.mixed_precision,
            "gradient_accumulation_steps": accelerator.gradient_accumulation_steps,
            "fsdp_sharded_modules": sum(isinstance(m, FSDPModule) for m in self.model.modules()),
            "launched_with": self._launch_config(),
            "counts": dict(self.counts),
        }
        return described

    def facts_after_training(self) -> dict:
        return {"accelerate": {**self.describe()["accelerate"], "counts": dict(self.counts)}}

    def _launch_config(self) -> dict | None:
        """The config file `accelerate launch` read (spec launcher accelerate), with what the
        ranks saw of it: Accelerate exports the file's mixed_precision to every rank."""
        if self.spec.launcher != "accelerate":
            return None
        import yaml

        path = run_files_dir(self.ctx.run_dir) / CONFIG_NAME
        if not path.is_file():
            raise FidelityError(f"launcher accelerate but no {path}: the ranks were not started from it")
        text = path.read_bytes()
        config = yaml.safe_load(text)
        return {"path": f"{RUN_FILES}/{CONFIG_NAME}", "sha256": hashlib.sha256(text).hexdigest(),
                "distributed_type": config.get("distributed_type"), "num_processes": config.get("num_processes"),
                "use_cpu": config.get("use_cpu"), "mixed_precision": config.get("mixed_precision"),
                "rank_env_mixed_precision": os.environ.get("ACCELERATE_MIXED_PRECISION")}

    def verify(self, described: dict) -> None:
        super().verify(described)
        spec, acc = self.spec, described["accelerate"]
        if acc["num_processes"] != spec.world_size:
            raise FidelityError(f"spec world_size {spec.world_size} but Accelerate runs {acc['num_processes']} "
                                f"process(es)")
        allowed = expected_distributed_types(spec)
        if acc["distributed_type"] not in allowed:
            raise FidelityError(f"Accelerate reports {acc['distributed_type']}; experiment {spec.id} needs "
                                f"{' or '.join(sorted(allowed))}")
        wrapped = described["wrapped_by"]
        if self.fsdp and wrapped != "FSDPModule (fully_shard)":
            raise FidelityError(f"FSDP through Accelerate asked, but the model is wrapped by {wrapped}: "
                                "refusing to report it under an FSDP label")
        if not self.fsdp and acc["distributed_type"] != "NO" and wrapped != "DistributedDataParallel":
            raise FidelityError(f"Accelerate {acc['distributed_type']} should wrap the model in "
                                f"DistributedDataParallel; found {wrapped}")
        launched = acc["launched_with"]
        if launched is not None:
            if launched["num_processes"] != spec.world_size:
                raise FidelityError(f"{CONFIG_NAME} asks for {launched['num_processes']} processes, "
                                    f"spec world_size is {spec.world_size}")
            if launched["mixed_precision"] != ACCELERATE_MIXED_PRECISION[spec.precision]:
                raise FidelityError(f"{CONFIG_NAME} says mixed_precision {launched['mixed_precision']}, spec "
                                    f"precision is {spec.precision}")
            if launched["mixed_precision"] != launched["rank_env_mixed_precision"]:
                raise FidelityError(f"{CONFIG_NAME} says mixed_precision {launched['mixed_precision']} but "
                                    f"accelerate launch gave the ranks {launched['rank_env_mixed_precision']}: "
                                    "the ranks were not started from that file")

    # -- the whole model and checkpoints -------------------------------------------------
    @property
    def collective_forward(self) -> bool:
        return self.fsdp  # FSDP's layers are gathered in forward: every rank joins

    def forward_logits(self, input_ids, every_rank=False, extra=None):
        if not self.fsdp:
            return super().forward_logits(input_ids, every_rank, extra)
        from distlab.strategies.fsdp import resharding_after_forward

        with resharding_after_forward(self.model, bool(self.spec.fsdp["reshard_after_forward"])):
            return super().forward_logits(input_ids, every_rank, extra)

    def save_checkpoint(self, path: str) -> None:
        """accelerator.save_state (model safetensors, optimizer, RNG per rank) into `path`, the
        model's frozen parameters left out (LoRA's base: named by identity in the checkpoint's
        metadata); distlab.checkpoints.checkpoint makes the save atomic around it."""
        import json

        from distlab.checkpoints.checkpoint import on_every_rank

        # Collective: a write that failed on one rank is SaveFailed on every rank, each having
        # reached the same collectives (on CPU save_state makes none after its writes; the
        # FSDP path's writes are DCP's, which gathers their errors itself).
        on_every_rank(lambda: self.accelerator.save_state(str(path)), "accelerator.save_state")

        def name_format():
            (Path(path) / "format.json").write_text(json.dumps({
                "format": "accelerate-save_state", "strategy": self.name,
                "distributed_type": self.accelerator.distributed_type.value,
                "world_size": dist.get_world_size(), "method": self.spec.method}))

        on_every_rank(name_format if dist.get_rank() == 0 else None, "the format file (rank 0)")

    def _drop_frozen(self, models, weights, _output_dir) -> None:
        """save_state pre-hook: each model's state dict loses its frozen parameters."""
        for model, state in zip(models, weights):
            frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
            for name in frozen & set(state):
                del state[name]

    def load_checkpoint(self, path: str) -> None:
        frozen = any(not p.requires_grad for p in self.model.parameters())
        # Not strict where frozen parameters were left out: they keep the base's values.
        self.accelerator.load_state(str(path), strict=not frozen)


# The class distlab.strategies finds for the strategy name "accelerate" (its module name).
STRATEGY = AccelerateStrategy
