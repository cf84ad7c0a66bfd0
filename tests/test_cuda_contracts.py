"""CUDA contracts proven on a CPU-only torch: every function that mixes a model's state with a
batch or a CPU tensor is fed a model whose tensors report `cuda:0`
(torch._subclasses.fake_tensor.FakeTensorMode; its FakeTensorDeviceMismatchError is the error a
real GPU raises) over a fake process group (collectives return at once; NCCL's rule that it
moves device tensors only is checked by a shim): each strategy's state_groups (the export's and
the validation's source), its forward_logits and the eval's loss, the rank-0 streamed forward
(logits recorded with a checkpoint, validation's reload/resume/reshard logits) and the export
(writer and recorded logits, with the file writes replaced by checks of what they receive).

Where this CPU-only build cannot go, a stand-in takes the place of what it cannot build, in the
form the real one leaves: FSDP2's fully_shard and tensor parallel's parallelize_module need a
CUDA runtime, so their parameters are made as DTensors sharded over a `cuda` mesh (FSDP:
Shard(0); with CPUOffloadPolicy the local shards live in host memory); a Hugging Face forward
on fake CUDA tensors stops at the first indexing op (its device guard needs the CUDA build), so
forward_logits runs a two-layer language model (embedding, head) on fake CUDA, and the export
pass gets the training model's logits as a fake CUDA tensor of their shape."""
from __future__ import annotations

import contextlib
import types

import pytest
import torch
import torch.distributed as dist
from distlab.records.job import Job

CUDA = torch.device("cuda", 0)


@pytest.fixture(scope="module")
def fake_group():
    """A fake 2-rank process group, this process rank 0, and a `cuda` device mesh over it."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield DeviceMesh("cuda", [0, 1])
    dist.destroy_process_group()


FAKE = None


def fake_mode():
    """The FakeTensorMode the fake tensors are made in. The code under test runs outside it, as
    it runs in a rank: the tensors it builds itself (rank 0's meta skeleton, the CPU batch) are
    real, and an op mixing them with a fake one runs in the fake tensor's mode."""
    global FAKE
    from torch._subclasses.fake_tensor import FakeTensorMode

    if FAKE is None:
        FAKE = FakeTensorMode(allow_non_fake_inputs=True)
    return FAKE


@pytest.fixture
def fake_cuda(monkeypatch):
    """Fake tensors have shapes and devices, no values: reading one (.item()) gives 0 here."""
    from torch._subclasses.fake_tensor import FakeTensor

    monkeypatch.setattr(FakeTensor, "item", lambda self: 0.0, raising=False)
    return fake_mode()


@pytest.fixture
def nccl_rules(monkeypatch):
    """Point-to-point transfers refuse host tensors, as NCCL does; object collectives (Python
    metadata, pickled) run outside the fake mode."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    real_gather = dist.all_gather_object

    def gather_objects(*args, **kwargs):
        with unset_fake_temporarily():
            return real_gather(*args, **kwargs)

    monkeypatch.setattr(dist, "all_gather_object", gather_objects)
    for name in ("send", "recv"):
        real = getattr(dist, name)

        def device_only(tensor, *args, _real=real, _name=name, **kwargs):
            if tensor.device.type != "cuda":
                raise RuntimeError(f"NCCL {_name}: tensor on {tensor.device}, NCCL moves CUDA tensors only")
            return _real(tensor, *args, **kwargs)

        monkeypatch.setattr(dist, name, device_only)


def on_fake_cuda(model):
    """Every parameter and buffer of a (meta or CPU) model replaced by a fake cuda:0 tensor."""
    with fake_mode():
        _fake_cuda_tensors(model)
    return model


def _fake_cuda_tensors(model):
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                module._parameters[name] = torch.nn.Parameter(torch.empty_like(param, device="cuda"),
                                                              requires_grad=param.requires_grad)
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[name] = torch.empty_like(buffer, device="cuda")
    return model


def sharded(model, mesh, placement_of, local_device="cuda"):
    """Parameters as DTensors over `mesh` with placement_of(name, param) (None: left plain),
    built as FSDP2 builds its sharded parameters (_from_local_no_grad: the local shard stays
    where it is, on the host under CPUOffloadPolicy)."""
    with fake_mode():
        return _sharded(model, mesh, placement_of, local_device)


def _sharded(model, mesh, placement_of, local_device):
    from torch.distributed.fsdp._fully_shard._fsdp_common import _from_local_no_grad
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    for module_name, module in model.named_modules():
        for leaf, param in list(module._parameters.items()):
            placement = placement_of(f"{module_name}.{leaf}", param) if param is not None else None
            if placement is None:
                continue
            dim = placement.dim
            local_shape = list(param.shape)
            local_shape[dim] = -(-local_shape[dim] // mesh.size())
            local = torch.empty(local_shape, dtype=param.dtype, device=local_device)
            spec = DTensorSpec(mesh, (placement,), TensorMeta(param.shape, param.stride(), param.dtype))
            value = _from_local_no_grad(local, spec)
            module._parameters[leaf] = torch.nn.Parameter(value, requires_grad=param.requires_grad)
    return model


@pytest.fixture
def no_file_writes(monkeypatch):
    """The export's writers check what they are given (CPU tensors) instead of writing bytes."""
    import safetensors.torch

    from distlab.records.export_files import SafetensorsFile

    seen = []

    def check_write(self, name, tensor):
        start, size, shape, dtype = self.offsets[name]
        assert tensor.device.type == "cpu" and tuple(tensor.shape) == shape, (name, tensor.device)
        seen.append(name)
        self.written.add(name)

    def check_save_file(tensors, *args, **kwargs):
        assert all(t.device.type == "cpu" for t in tensors.values()), {k: t.device for k, t in tensors.items()}
        seen.extend(tensors)

    monkeypatch.setattr(SafetensorsFile, "write", check_write)
    monkeypatch.setattr(safetensors.torch, "save_file", check_save_file)
    return seen


def make(strategy_cls, spec: dict, module):
    from distlab.strategies.base import RunContext
    from distlab.tasks import task_for

    strategy = strategy_cls(RunContext(spec=spec, run_dir="unused", device=CUDA, task=task_for(spec)))
    strategy.model = module
    return strategy


def llama(prepared, spec=None):
    from distlab.runtime.lora import apply_lora
    from distlab.runtime.model import load_model

    model = load_model(prepared / "model", device="meta")
    if spec is not None and spec["method"] == "lora":
        model, _ = apply_lora(model, spec["lora"], spec["seed"])
    return on_fake_cuda(model)


def spec_of(strategy: str, method: str = "full", **over):
    from conftest import resolve

    stage = {"ddp": "ddp", "accelerate": "accelerate", "deepspeed": "deepspeed", "fsdp": "fsdp"}.get(strategy,
                                                                                                    "parallel")
    return resolve({"strategy": strategy, "method": method, "world_size": 2, "micro_batch": 4, **over}, stage=stage)


def assert_whole_model_paths_stay_on_the_host(strategy, prepared, tmp_path, written, monkeypatch):
    """The export pass (gathered groups, rank 0's streamed forward, writers, recorded logits)
    and the validation ranks' streamed logits."""
    from distlab.checkpoints.export import EVAL_BATCH, EVAL_TOKENS, export_pass
    from distlab.rank.validate_ranks import ValidationRank

    job = Job(spec=strategy.spec, run_dir=str(tmp_path), model_source=str(prepared / "model"),
              data_dir=str(prepared / "data32"))
    vocab = strategy.unwrapped().config.vocab_size
    with fake_mode():
        training_logits = torch.empty(EVAL_BATCH, EVAL_TOKENS, vocab, device=CUDA)
    monkeypatch.setattr(strategy, "forward_logits", lambda batch: training_logits)
    monkeypatch.setattr(strategy, "state_groups", on_the_rank(strategy.state_groups))
    info, error = export_pass(strategy, job, strategy.spec, tmp_path)
    assert error is None, error
    assert info["layout"] and written, info
    validator = ValidationRank.__new__(ValidationRank)
    validator.rank, validator.job, validator.spec, validator.task = 0, job, strategy.spec, strategy.task
    _, logits = validator.trained_outputs(strategy)
    assert logits.device.type == "cpu"


def on_the_rank(state_groups):
    """The strategy's own code runs in the fake mode (what it allocates on the device is fake
    CUDA); rank 0's consumers run outside it (their CPU tensors are real)."""
    def groups(select=None):
        source = state_groups(select)
        while True:
            with fake_mode():
                group = next(source, None)
            if group is None:
                return
            yield group

    return groups


class TinyLM(torch.nn.Module):
    """A language model without indexing ops (see the module docstring): embedding, head."""

    def __init__(self, vocab: int):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(vocab, 8), torch.nn.Linear(8, vocab)

    def forward(self, input_ids):
        return types.SimpleNamespace(logits=self.head(self.embed(input_ids)))


def test_ddp_state_reaches_the_cpu_forward_and_the_export_on_the_host(fake_group, fake_cuda, prepared, tmp_path,
                                                                      no_file_writes, monkeypatch):
    from distlab.strategies.ddp import DDPStrategy

    strategy = make(DDPStrategy, spec_of("ddp"), types.SimpleNamespace(module=llama(prepared)))
    assert_whole_model_paths_stay_on_the_host(strategy, prepared, tmp_path, no_file_writes, monkeypatch)


def test_ddp_native_checkpoint_is_written_from_host_copies_of_the_device_parameters(fake_group, fake_cuda, prepared,
                                                                                   tmp_path, no_file_writes):
    """save_plain (DDP's native format) writes the live trainable parameters: on a GPU they are
    CUDA tensors, which the safetensors writer refuses."""
    from distlab.strategies.ddp import DDPStrategy

    spec = spec_of("ddp", "lora")
    strategy = make(DDPStrategy, spec, types.SimpleNamespace(module=llama(prepared, spec)))
    strategy.optimizer = types.SimpleNamespace(state_dict=lambda: {"state": {}, "param_groups": []})
    strategy.save_checkpoint(str(tmp_path / "state"))
    trained = [n for n, p in strategy.unwrapped().named_parameters() if p.requires_grad]
    assert trained and sorted(no_file_writes) == sorted(trained)


def test_ddp_lora_adapters_and_base_reach_the_host(fake_group, fake_cuda, prepared, tmp_path, no_file_writes,
                                                   monkeypatch):
    from peft import PeftModel

    from distlab.strategies.ddp import DDPStrategy

    saved = []
    monkeypatch.setattr(PeftModel, "save_pretrained", lambda self, folder, state_dict, **kw: saved.append(
        {k: v.device.type for k, v in state_dict.items()}))
    spec = spec_of("ddp", "lora")
    strategy = make(DDPStrategy, spec, types.SimpleNamespace(module=llama(prepared, spec)))
    assert_whole_model_paths_stay_on_the_host(strategy, prepared, tmp_path, no_file_writes, monkeypatch)
    assert saved and set(saved[0].values()) == {"cpu"}


def test_accelerate_state_reaches_the_host(fake_group, fake_cuda, prepared, tmp_path, no_file_writes, monkeypatch):
    from distlab.strategies.accelerate import AccelerateStrategy

    model = llama(prepared)
    strategy = make(AccelerateStrategy, spec_of("accelerate"), model)
    strategy.accelerator = types.SimpleNamespace(unwrap_model=lambda m: m)
    assert_whole_model_paths_stay_on_the_host(strategy, prepared, tmp_path, no_file_writes, monkeypatch)


@pytest.mark.parametrize("offload", [False, True])
def test_fsdp_shards_are_gathered_on_the_device_and_reach_the_host(fake_group, fake_cuda, prepared, tmp_path,
                                                                   no_file_writes, offload, monkeypatch):
    """CPUOffloadPolicy keeps the shards in host memory: they go to the device for the
    all-gather (NCCL gathers CUDA tensors), and the whole tensor comes back to the host."""
    from torch.distributed.tensor import Shard

    from distlab.strategies.fsdp import FSDPStrategy

    model = sharded(llama(prepared), fake_group, lambda name, p: Shard(0), "cpu" if offload else "cuda")
    strategy = make(FSDPStrategy, spec_of("fsdp", fsdp={"cpu_offload": offload}), model)
    assert_whole_model_paths_stay_on_the_host(strategy, prepared, tmp_path, no_file_writes, monkeypatch)


def test_tensor_parallel_slices_are_gathered_and_reach_the_host(fake_group, fake_cuda, prepared, tmp_path,
                                                                no_file_writes, monkeypatch):
    from torch.distributed.tensor import Shard

    from distlab.strategies.tp import TensorParallelStrategy

    def megatron(name, param):  # q/k/v/gate/up by output rows, o/down by input columns
        if ".layers." not in name or param.dim() != 2:
            return None
        return Shard(1) if name.endswith(("o_proj.weight", "down_proj.weight")) else Shard(0)

    model = sharded(llama(prepared), fake_group, megatron)
    strategy = make(TensorParallelStrategy, spec_of("tp"), model)
    assert_whole_model_paths_stay_on_the_host(strategy, prepared, tmp_path, no_file_writes, monkeypatch)


def test_zero3_gathered_partitions_reach_the_host(fake_group, fake_cuda, prepared, tmp_path, no_file_writes,
                                                  monkeypatch):
    """ZeRO-3's GatheredParameters leaves each parameter whole on the device; the stand-in is
    that gathered state (its partition bookkeeping needs a real engine)."""
    import deepspeed

    from distlab.strategies.deepspeed import DeepSpeedStrategy

    model = llama(prepared)
    for index, param in enumerate(model.parameters()):
        param.ds_id = index
    gathers = []
    monkeypatch.setattr(deepspeed.zero, "GatheredParameters",
                        lambda params, modifier_rank=None: gathers.append(len(params)) or contextlib.nullcontext())
    engine = types.SimpleNamespace(module=model)
    strategy = make(DeepSpeedStrategy, spec_of("deepspeed", deepspeed={"zero_stage": 3}), engine)
    assert_whole_model_paths_stay_on_the_host(strategy, prepared, tmp_path, no_file_writes, monkeypatch)
    assert gathers and max(gathers) <= len(list(model.model.layers[0].parameters()))  # a layer at a time


def test_pipeline_stages_travel_as_device_tensors_and_reach_the_host(fake_group, fake_cuda, prepared, tmp_path,
                                                                     no_file_writes, nccl_rules, monkeypatch):
    """Rank 0 holds stage 0; the other stage's groups (and the last stage's logits) arrive by
    point-to-point transfer into device buffers, then go to the host."""
    from distlab.strategies.pp import PipelineParallelStrategy
    from distlab.strategies.pp_stages import StageModule, prune_to_stage, split_layers

    stages = []
    for first in (True, False):
        model = llama(prepared)
        strategy = make(PipelineParallelStrategy, spec_of("pp"), model)
        bounds = split_layers(len(model.model.layers), 2)
        layer = prune_to_stage(model, bounds[0 if first else 1], first, not first)
        strategy.first, strategy.last, strategy.bounds = first, not first, bounds
        strategy.stage_module = StageModule(model, layer, first, not first)
        stages.append(strategy)
    gather = dist.all_gather_object  # nccl_rules' (outside the fake mode)

    def gather_stages(out, mine):  # the fake group copies rank 0's part: rank 1 holds stage 1
        gather(out, mine)
        out[1] = stages[1].held_groups()

    monkeypatch.setattr(dist, "all_gather_object", gather_stages)
    assert_whole_model_paths_stay_on_the_host(stages[0], prepared, tmp_path, no_file_writes, monkeypatch)


def tiny_strategy(name: str, vocab: int, monkeypatch):
    """A strategy of each kind around TinyLM on fake CUDA, as its forward_logits reaches it."""
    from distlab.strategies import strategy_for

    model = on_fake_cuda(TinyLM(vocab))
    extra = {"deepspeed": {"zero_stage": 3}} if name == "deepspeed" else {}
    spec = spec_of(name, **extra)
    module = types.SimpleNamespace(module=model) if name == "ddp" else model
    if name == "deepspeed":  # the engine is a module whose forward is its module's
        module = model
        model.module = types.SimpleNamespace()
    strategy = make(strategy_for(spec), spec, module)
    if name == "deepspeed":
        monkeypatch.setattr(strategy, "unwrapped", lambda: model)
        model.zero_optimization_stage = lambda: 3
        model.empty_partition_cache = lambda: None
    if name == "accelerate":
        strategy.accelerator = types.SimpleNamespace(unwrap_model=lambda m: m)
    if name == "fsdp":  # FSDPModule's own switch, recorded (an evaluation forward reshards each layer)
        model.reshard_settings = []
        model.set_reshard_after_forward = model.reshard_settings.append
    return strategy


@pytest.mark.parametrize("name", ["ddp", "accelerate", "fsdp", "tp", "deepspeed"])
def test_forward_logits_takes_the_cpu_batch_to_the_model_and_the_eval_loss_takes_the_labels(
        fake_group, fake_cuda, prepared, monkeypatch, name):
    from distlab.runtime.evaluation import eval_tokens, loss_terms

    ids, labels = eval_tokens(prepared / "data32", 2)  # CPU tensors, as the eval reads them
    strategy = tiny_strategy(name, int(ids.max()) + 1, monkeypatch)
    with fake_mode():  # a rank's forward: the batch's move to the device makes a (fake) CUDA tensor
        logits = strategy.forward_logits(ids)
        total, count = loss_terms(logits, labels)
    assert logits.device == CUDA and total.device == CUDA
    if name == "fsdp":
        assert strategy.model.reshard_settings == [True, strategy.spec["fsdp"]["reshard_after_forward"]]


def test_pipeline_forward_logits_send_activations_and_logits_as_device_tensors(fake_group, fake_cuda, prepared,
                                                                              nccl_rules):
    from distlab.runtime.evaluation import eval_tokens
    from distlab.strategies.pp import PipelineParallelStrategy

    ids, _ = eval_tokens(prepared / "data32", 2)
    model = on_fake_cuda(TinyLM(int(ids.max()) + 1))
    model.config = types.SimpleNamespace(hidden_size=8, vocab_size=int(ids.max()) + 1)
    strategy = make(PipelineParallelStrategy, spec_of("pp"), model)
    strategy.first, strategy.last = True, False
    strategy.stage_module = lambda x: model.embed(x)  # stage 0: its activations go on to stage 1
    with fake_mode():
        logits = strategy.forward_logits(ids)  # rank 0 of 2: receives the last stage's logits
    assert logits.device == CUDA
