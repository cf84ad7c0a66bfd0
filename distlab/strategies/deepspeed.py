"""DeepSpeed ZeRO 0-3, with optimizer/parameter offload: deepspeed.initialize with a JSON
config generated from the spec (distlab.strategies.deepspeed_config), written beside the results
and read back from that file.

DeepSpeed's engine owns gradient accumulation (engine.backward scales by 1/GAS and
engine.step only updates on the accumulation boundary), so every micro-batch calls
backward and step; the loop's optimizer_step is the boundary's step.
"""
from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

from distlab.runtime.accumulation import for_backward
from distlab.checkpoint_formats.zero import zero_load, zero_save
from distlab.runtime.model import decoder_layers
from distlab.configuration.precision import deepspeed_precision, torch_dtype
from distlab.records.run_layout import run_files_dir
from distlab.strategies.base import FidelityError, Strategy
from distlab.strategies.deepspeed_config import (CONFIG_NAME, deepspeed_config, file_sha256, gradient_bucket_size,
                                                uses_torch_adam, write_config)
from distlab.strategies.deepspeed_state import engine_state_bytes, estimator_bytes

def full_numel(param) -> int:
    """Elements of a parameter, also of a ZeRO-3 partitioned one (whose .numel() is 0)."""
    return getattr(param, "ds_numel", None) or param.numel()


def skip_inference_shm_op() -> None:
    """DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce op on its first
    init_distributed (about 3 minutes on a busy 2-core machine). Only its
    inference_all_reduce uses it; training collectives go through torch.distributed over
    gloo, so the op is not built. (deepspeed 0.17-0.19: deepspeed.comm.torch.build_shm_op)"""
    import importlib

    # import_module, not `import deepspeed.comm.torch as`: deepspeed.comm re-exports the torch
    # package under that attribute name.
    ds_torch_backend = importlib.import_module("deepspeed.comm.torch")
    if hasattr(ds_torch_backend, "build_shm_op"):
        ds_torch_backend.build_shm_op = lambda: None


def forget_deepspeed_groups() -> None:
    """DeepSpeed caches process groups in module globals; a process that destroys and
    re-creates its process group (checkpoint validation reuses its ranks) must not hand
    the new engine groups of the old one."""
    from deepspeed.utils import groups

    for name in ("_WORLD_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP",
                 "_MODEL_PARALLEL_GROUP", "_TENSOR_MODEL_PARALLEL_GROUP", "mpu"):
        if hasattr(groups, name):
            setattr(groups, name, None)
    for name in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
                 "_EXPERT_DATA_PARALLEL_GROUP_RANKS", "_ALL_TO_ALL_GROUP"):
        if isinstance(getattr(groups, name, None), dict):
            getattr(groups, name).clear()


class DeepSpeedStrategy(Strategy):
    name = "deepspeed"
    expected_wrappers = ("DeepSpeedEngine",)

    def init_distributed(self) -> None:
        import deepspeed

        if dist.is_initialized():
            return
        if self.ctx.device.type == "cuda":
            torch.cuda.set_device(self.ctx.device)
        else:
            skip_inference_shm_op()
        deepspeed.init_distributed(dist_backend="nccl" if self.ctx.device.type == "cuda" else "gloo",
                                   timeout=self.collective_timeout)

    def load_model(self, model_source: str):
        """The weights in the dtype DeepSpeed keeps its module in (bf16/fp16 with fp32 masters
        in the optimizer, else fp32). At ZeRO-3 the model is built under deepspeed.zero.Init,
        so each parameter is partitioned (and offloaded where configured) as it is built, and
        each rank reads only its partitions from the safetensors (the task's load_partitioned,
        handed strategies.deepspeed_load): no rank holds or reads the whole model."""
        dtype = torch_dtype(self.spec.precision)
        if self.spec.method == "qlora":  # ZeRO 0-2 in fp32 only (distlab.configuration.training_tools)
            return super().load_model(model_source)
        if self.spec.deepspeed["zero_stage"] != 3:
            return self.task.load_model(model_source, dtype=dtype)
        if self.ctx.device.type == "cpu":
            skip_inference_shm_op()
        forget_deepspeed_groups()
        from distlab.strategies import deepspeed_load

        # zero.Init reads the partitioning, persistence and offload keys only; the live-parameter
        # limits sized from the built model are the engine's (wrap).
        model, self.load_report = self.task.load_partitioned(
            model_source, deepspeed_config(self.spec, dist.get_world_size(),
                                           hidden_size=self.task.hidden_size(model_source)),
            dtype, nvme_params=self.spec.deepspeed["offload_param"] == "nvme", zero=deepspeed_load)
        self.partitioned_at_load = all(hasattr(p, "ds_id") for p in model.parameters())
        return model

    def wrap(self, model) -> None:
        import deepspeed

        world = dist.get_world_size()
        layer_params = sum(full_numel(p) for p in decoder_layers(model)[0].parameters())
        trainable = [full_numel(p) for p in self.trainable(model)]
        config = deepspeed_config(self.spec, world, layer_params if self.spec.deepspeed["zero_stage"] == 3 else None,
                                  gradient_bucket_size(layer_params, max(trainable), sum(trainable)),
                                  hidden_size=getattr(model.config, "hidden_size", None))
        # Checkpoint validation reloads at another world size in the same run folder: its
        # config (another train_batch_size) goes beside the experiment's, never over it.
        name = CONFIG_NAME if world == self.spec.world_size else f"deepspeed_config-world{world}.json"
        if dist.get_rank() == 0:
            write_config(config, run_files_dir(self.ctx.run_dir), name)
        dist.barrier()
        self.config_path = str(run_files_dir(self.ctx.run_dir) / name)
        self.config_sha256 = file_sha256(self.config_path)
        self.largest_layer_params = max(sum(full_numel(p) for p in m.parameters(recurse=False))
                                        for m in model.modules())
        self.total_params = sum(full_numel(p) for p in model.parameters() if p.requires_grad)
        if not any(hasattr(p, "ds_id") for p in model.parameters()):  # zero.Init placed partitions already
            model.to(self.ctx.device)
        if self.ctx.device.type == "cpu":
            skip_inference_shm_op()  # also when the caller set up the process group itself
        forget_deepspeed_groups()
        # The file on disk, not the dict: what a user reruns by hand is what ran here.
        # The run's LR schedule is handed to the engine, which steps it on each boundary's step
        # and saves it in its checkpoints (distlab.runtime.schedule builds it on DeepSpeed's optimizer).
        from distlab.runtime.schedule import lr_scheduler

        engine, optimizer, _, scheduler = deepspeed.initialize(
            model=model, model_parameters=self.trainable(model), config=self.config_path,
            lr_scheduler=lambda ds_optimizer: lr_scheduler(self.spec, ds_optimizer))
        self.model, self.optimizer, self.scheduler = engine, optimizer, scheduler

    def gradient_divisor(self, n_micro: int) -> int:
        # engine.backward divides the loss by gradient_accumulation_steps, and ZeRO's gradient
        # reduction averages over the data-parallel ranks.
        return self.data_parallel_size * n_micro

    def forward_backward(self, batch, micro_index: int, n_micro: int, num_items):
        engine = self.model
        if n_micro != engine.gradient_accumulation_steps():
            raise FidelityError(f"the loop accumulates {n_micro} micro-batches but the DeepSpeed engine "
                                f"{engine.gradient_accumulation_steps()}")
        # bf16/fp16 are DeepSpeed's (low-precision module + fp32 master), not autocast.
        share = self.task.loss(engine, batch, num_items)
        engine.backward(for_backward(share, self.gradient_divisor(n_micro)))
        if engine.global_steps == self.spec.steps - 1:
            self._record_peak_state()
        if micro_index < n_micro - 1:
            engine.step()  # not a boundary: DeepSpeed only counts the micro-step
        return share.detach()

    def optimizer_step(self):
        """The boundary's engine.step(): DeepSpeed clips to its gradient_clipping (= max_grad_norm)
        and steps the LR schedule itself. Returns the pre-clip global norm: ZeRO 1-3 compute it
        over their partitions (engine.get_global_grad_norm); ZeRO-0's plain optimizer does not,
        so it is taken here from the whole, already averaged gradients before the step."""
        from distlab.runtime.clipping import global_grad_norm

        engine = self.model
        if not engine.is_gradient_accumulation_boundary():
            raise FidelityError("optimizer_step called off DeepSpeed's gradient-accumulation boundary")
        before = engine.global_steps
        whole = engine.zero_optimization_stage() == 0 and not (engine.bfloat16_enabled() or engine.fp16_enabled())
        norm = global_grad_norm(self.trainable(engine.module)) if whole else None
        engine.step()
        if engine.global_steps != before + 1:
            raise FidelityError("DeepSpeed's engine.step() did not advance the optimizer step")
        return norm if whole else engine.get_global_grad_norm()

    def step_scheduler(self) -> None:
        # engine.step() stepped it: check it did, once per optimizer step (never a second time here).
        if self.scheduler.last_epoch != self.model.global_steps:
            raise FidelityError(f"DeepSpeed's engine stepped the LR schedule {self.scheduler.last_epoch} times in "
                                f"{self.model.global_steps} optimizer steps")

    def take_comm_seconds(self) -> None:
        # DeepSpeed's comms logger makes every collective blocking to time it, which would
        # change what is measured; so communication time is not measured (None, not 0).
        return None

    def unwrapped(self):
        return self.model.module

    # -- truth --------------------------------------------------------------------------
    def offload_devices(self) -> dict:
        zero = self.model._config.zero_config
        out = {}
        for key in ("offload_optimizer", "offload_param"):
            block = getattr(zero, key)
            device = getattr(block, "device", None) if block is not None else None
            out[key] = getattr(device, "value", device) or "none"
        return out

    def describe(self) -> dict:
        out = super().describe()
        engine = self.model
        out["deepspeed"] = {
            "engine": type(engine).__name__,
            "zero_stage": int(engine.zero_optimization_stage()),
            **self.offload_devices(),
            "optimizer": type(self.optimizer).__name__,
            "basic_optimizer": type(engine.basic_optimizer).__name__,
            "micro_batch": engine.train_micro_batch_size_per_gpu(),
            "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
            "train_batch_size": engine.train_batch_size(),
            "bf16": engine.bfloat16_enabled(), "fp16": engine.fp16_enabled(),
            "gradient_clipping": engine.gradient_clipping(),
            "config_path": os.path.relpath(self.config_path, self.ctx.run_dir),
            "config_sha256": self.config_sha256,
            "config_used": engine.config,
            "partitioned_at_load": getattr(self, "partitioned_at_load", False),
            "load": getattr(self, "load_report", None),
            "comm_time": "not measured: DeepSpeed's comms logger blocks on every collective to time it",
            "estimator": estimator_bytes(self.spec.deepspeed, self.total_params, self.largest_layer_params,
                                         dist.get_world_size(), zero_init=getattr(self, "partitioned_at_load", False)),
        }
        return out

    def verify(self, described: dict) -> None:
        super().verify(described)
        ds, want = described["deepspeed"], self.spec.deepspeed
        if ds["zero_stage"] != want["zero_stage"]:
            raise FidelityError(f"spec ZeRO stage {want['zero_stage']} but the engine runs stage {ds['zero_stage']}")
        for key in ("offload_optimizer", "offload_param"):
            if ds[key] != want[key]:
                raise FidelityError(f"spec {key} {want[key]} but the engine offloads to {ds[key]}")
        if want["zero_stage"] == 3 and not ds["partitioned_at_load"]:
            raise FidelityError("ZeRO-3: the model was not built under deepspeed.zero.Init "
                                "(every rank loaded it whole)")
        spec = self.spec
        if (ds["micro_batch"], ds["gradient_accumulation_steps"]) != (spec.micro_batch, spec.grad_accum):
            raise FidelityError(f"spec micro_batch {spec.micro_batch} x grad_accum {spec.grad_accum} but the "
                                f"engine uses {ds['micro_batch']} x {ds['gradient_accumulation_steps']}")
        wanted = deepspeed_precision(spec.precision)
        if ds["bf16"] != wanted["bf16"]["enabled"] or ds["fp16"] != wanted["fp16"]["enabled"]:
            raise FidelityError(f"spec precision {spec.precision} but the engine has bf16={ds['bf16']} "
                                f"fp16={ds['fp16']}")
        torch_adam = ds["basic_optimizer"] in ("AdamW", "Adam")
        if torch_adam != uses_torch_adam(spec):
            raise FidelityError(f"spec optimizer_impl {want['optimizer_impl']} but the engine's optimizer is "
                                f"{ds['basic_optimizer']}")

    def _record_peak_state(self) -> None:
        """Model state after each backward of the last step, keeping the largest: ZeRO-1
        holds whole gradients only between the micro-batches of an accumulated step."""
        now = engine_state_bytes(self.model, self.offload_devices())
        total = sum(v for v in now.values() if isinstance(v, int))
        if total >= getattr(self, "_peak_total", -1):
            self._peak_state, self._peak_total = now, total

    def state_bytes(self) -> dict:
        state = dict(getattr(self, "_peak_state", None) or engine_state_bytes(self.model, self.offload_devices()))
        state["how"] += ("; the largest of the snapshots taken after each backward of the last step "
                         "(gradients exist in full only within an accumulated step)")
        return state

    # -- the whole model and checkpoints -------------------------------------------------
    collective_forward = True  # ZeRO-3 gathers each layer's partitions in forward: every rank joins

    def eval_context(self):
        return contextlib.nullcontext()  # bf16/fp16 are DeepSpeed's module dtype, not autocast

    def forward_logits(self, input_ids, every_rank=False, extra=None):
        logits = super().forward_logits(input_ids, every_rank, extra)
        if self.model.zero_optimization_stage() == 3:
            # A forward without its backward leaves ZeRO-3's prefetched partitions in flight;
            # gathering them again (state_groups, the next forward) asserts on them.
            self.model.empty_partition_cache()
        return logits

    def state_groups(self, select=None):
        """Strategy.state_groups, ZeRO-3 partitions gathered one decoder layer at a time
        (deepspeed.zero.GatheredParameters) and copied to host memory on rank 0 before they are
        released. With bf16 these are the module's bf16 weights, not DeepSpeed's fp32 masters."""
        import deepspeed

        from distlab.runtime.streamed import host, parameter_groups

        module = self.unwrapped()
        params = dict(module.named_parameters())
        main = dist.get_rank() == 0
        for names in parameter_groups(module, select):
            partitioned = [params[n] for n in names if hasattr(params[n], "ds_id")]
            with (deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None) if partitioned
                  else contextlib.nullcontext()):
                # A copy: the gathered storage is freed when the context exits.
                group = {n: host(params[n], copy=bool(partitioned)) for n in names} if main else {}
            yield group

    def save_checkpoint(self, path: str) -> None:
        zero_save(self, path)  # DeepSpeed's native layout: per-rank ZeRO partitions

    def load_checkpoint(self, path: str) -> None:
        zero_load(self, path)


# The class distlab.strategies finds for the strategy name "deepspeed" (its module name).
STRATEGY = DeepSpeedStrategy
