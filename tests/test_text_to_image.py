"""The text-to-image task: LoRA on a tiny Stable Diffusion UNet, trained by every strategy that
runs it, through the real workflow (one module-scoped `snakemake` run checked by every test
below), against a plain diffusers loop, a plain StableDiffusionPipeline and a real browser."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import REPO, snakemake, tiny_config
from distlab.records.run_outputs import read_run_record

MACHINE = "testbox"
SD = {"task": "text-to-image", "method": "lora", "micro_batch": 2}
STAGES = {
    "ddp": {"experiments": [{**SD, "strategy": "ddp", "world_size": 2}]},
    # The stage-2 pair: the same spec but world_size (the Accelerate config file is all that changes).
    "accelerate": {"experiments": [{**SD, "strategy": "accelerate", "world_size": 1},
                                   {**SD, "strategy": "accelerate", "world_size": 2}]},
    "deepspeed": {"experiments": [{**SD, "strategy": "deepspeed", "world_size": 2, "deepspeed": {"zero_stage": 2}},
                                  {**SD, "strategy": "deepspeed", "world_size": 2, "deepspeed": {"zero_stage": 3}}]},
    "fsdp": {"experiments": [{**SD, "strategy": "fsdp", "world_size": 2}]},
}
# alpha != r: the export must carry the adapter's scale (diffusers' LoRA metadata) to reproduce the run.
LORA = {"r": 4, "alpha": 8}


def sd_config() -> dict:
    cfg = tiny_config(STAGES, machine=MACHINE, collectives={"enabled": False}, validation={"scope": "none"})
    cfg["defaults"].update(steps=3, untimed_steps=1, lora=dict(LORA))
    cfg["text_to_image"] = {"data": {"max_images": 64, "eval_images": 4},
                            "samples": {"prompts": ["a handwritten digit seven"], "seeds": [0], "steps": 2}}
    return cfg


@pytest.fixture(scope="module")
def workflow(tmp_path_factory):
    """(results folder, {experiment: metrics}) of one `snakemake --cores 2` run of every strategy."""
    from distlab.configuration import hardware

    work = tmp_path_factory.mktemp("text-to-image")
    (work / "results" / MACHINE).mkdir(parents=True)
    info = hardware.describe(MACHINE, probe=False)
    info["cpu_peak"] = {"per_thread": hardware.measure_cpu_matmul_peak(1, size=256, seconds=0.2)}
    (work / "results" / MACHINE / "hardware.json").write_text(json.dumps(info))
    snakemake(work, "--cores", "2", config=sd_config())
    results = work / "results"
    runs = {p.parent.name: read_run_record(p).to_dict() for p in (results / MACHINE).glob("*/metrics.json")}
    return results, runs


def step0_reference_loss(results: Path, run: dict) -> float:
    """A plain diffusers loop (no distlab model, strategy or loss code) on the run's step-0 images,
    captions, noise and timesteps: the components from the folder, LoRA added with the run's seed,
    the example's steps written out. Per-rank means averaged, as the run reports its loss."""
    import datasets
    import torch.nn.functional as F
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from diffusers.utils.torch_utils import randn_tensor
    from peft import LoraConfig
    from transformers import CLIPTextModel, CLIPTokenizer

    from distlab.tasks.text_to_image.data import pick_caption, sample_generator, transform

    folder = str(results / "prep" / "sd-model")
    spec = run["spec"]
    vae = AutoencoderKL.from_pretrained(folder, subfolder="vae")
    text_encoder = CLIPTextModel.from_pretrained(folder, subfolder="text_encoder")
    tokenizer = CLIPTokenizer.from_pretrained(folder, subfolder="tokenizer")
    scheduler = DDPMScheduler.from_pretrained(folder, subfolder="scheduler")
    unet = UNet2DConditionModel.from_pretrained(folder, subfolder="unet")
    unet.requires_grad_(False)
    torch.manual_seed(spec["seed"])
    unet.add_adapter(LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], init_lora_weights="gaussian",
                                target_modules=["to_k", "to_q", "to_v", "to_out.0"]))
    rows = datasets.load_from_disk(str(results / "prep" / "sd-data"))["train"]
    steps = [json.loads(line) for line in (Path(run["_dir"]) / "steps.jsonl").read_text().splitlines()]
    losses = []
    for indices in steps[0]["samples_by_rank"]:
        gens = [sample_generator(spec["seed"], 0, i) for i in indices]
        pixels = torch.stack([transform(rows[i]["image"], spec["text_to_image"], g, train=True)
                              for i, g in zip(indices, gens)])
        captions = [pick_caption(rows[i]["text"], g, train=True) for i, g in zip(indices, gens)]
        with torch.no_grad():
            latents = vae.encode(pixels).latent_dist.sample(generator=gens) * vae.config.scaling_factor
            noise = randn_tensor(latents.shape, generator=gens)
            timesteps = torch.cat([torch.randint(0, scheduler.config.num_train_timesteps, (1,), generator=g)
                                   for g in gens])
            noisy = scheduler.add_noise(latents, noise, timesteps)
            ids = tokenizer(captions, max_length=tokenizer.model_max_length, padding="max_length", truncation=True,
                            return_tensors="pt").input_ids
            states = text_encoder(ids, return_dict=False)[0]
            prediction = unet(noisy, timesteps, states, return_dict=False)[0]
        losses.append(F.mse_loss(prediction.float(), noise.float()).item())
    return sum(losses) / len(losses)


@pytest.mark.slow
def test_every_strategy_starts_from_the_loss_of_a_plain_diffusers_loop(workflow):
    results, runs = workflow
    assert len(runs) == 6 and all(run["status"] == "ok" for run in runs.values()), sorted(runs)
    for name, run in runs.items():
        run["_dir"] = str(results / MACHINE / name)
        expected = step0_reference_loss(results, run)
        assert abs(run["loss"]["first"] - expected) <= 1e-5, (name, run["loss"]["first"], expected)
        assert run["spec"]["task"] == "text-to-image" and name.endswith("-sd")


@pytest.mark.slow
def test_strategies_wrap_only_the_unet_and_zero3_keeps_the_frozen_parts_out_of_zero_init(workflow):
    _, runs = workflow
    for name, run in runs.items():
        frozen = run["as_built"]["task"]["frozen"]
        for part in ("vae", "text_encoder"):
            assert frozen[part]["zero3_partitioned"] == 0 and frozen[part]["trainable"] == 0, (name, frozen)
        assert run["parameters"]["total"] < 20_000  # the UNet alone (16,928 + LoRA), not VAE/text encoder
    zero3 = runs["deepspeed-z3-lora-w2-mb2-ga1-sd"]["as_built"]
    assert zero3["deepspeed"]["partitioned_at_load"] and set(zero3["parameter_layout"]) == {"deepspeed_partition"}
    assert "zero.Init" in zero3["deepspeed"]["load"]["how"]
    fsdp = runs["fsdp-fullshard-lora-w2-mb2-ga1-sd"]["as_built"]
    # fully_shard units: the UNet's first _no_split_modules class found (ResnetBlock2D: 8 in the tiny UNet),
    # then the root.
    assert fsdp["fsdp_layers"] == 8 and fsdp["dtensor_parameters"] == fsdp["parameters"]
    # DDP's find_unused_parameters is recorded, and off: every LoRA weight gets a gradient each step.
    for name in ("ddp-lora-w2-mb2-ga1-sd", "accelerate-lora-w2-mb2-ga1-sd"):
        assert runs[name]["as_built"]["find_unused_parameters"] is False


@pytest.mark.slow
def test_runs_measure_images_per_s_flops_memory_and_the_same_heldout_loss_for_the_base(workflow):
    _, runs = workflow
    bases = {run["eval"]["base"]["loss"] for run in runs.values()}
    assert len(bases) == 1  # one base evaluation, the same images/noise/timesteps for every run
    for name, run in runs.items():
        world = run["spec"]["world_size"]
        tp = run["throughput"]
        assert tp["unit"] == "image" and "tokens_per_s" not in tp
        assert tp["images_per_step"] == 2 * world and tp["images_per_s"] > 0
        assert tp["images_per_s_per_rank"] == pytest.approx(tp["images_per_s"] / world)
        assert run["flops"]["flops_per_image"] > 1e6 and run["flops"]["mfu"] > 0
        assert len(run["memory"]["per_rank"]) == world
        for rank in run["memory"]["per_rank"]:  # load, training, and through eval, sampling, save and export
            assert 0 < rank["load_phase"]["rss_peak_bytes"] and 0 < rank["training_phase"]["rss_peak_bytes"]
            # ru_maxrss over the whole process: not comparable byte for byte with VmHWM since a reset.
            assert rank["peak_through_save_bytes"] > 0, (name, rank)
        trained = run["eval"]["trained"]
        assert trained["images"] == 4 and trained["loss"] > 0 and trained["loss"] != run["eval"]["base"]["loss"]
    # FLOPs are counted on a meta copy from the UNet's config: the same for every strategy.
    assert len({run["flops"]["flops_per_image"] for run in runs.values()}) == 1


@pytest.mark.slow
def test_saved_lora_loads_in_plain_diffusers_and_reproduces_the_runs_output(workflow):
    from diffusers import StableDiffusionPipeline
    from safetensors.torch import load_file

    from distlab.tasks.text_to_image.data import FIXED_BATCH, FrozenEncoders, heldout_inputs

    results, runs = workflow
    for name in ("accelerate-lora-w1-mb2-ga1-sd", "deepspeed-z3-lora-w2-mb2-ga1-sd"):
        final = results / MACHINE / name / "checkpoint" / "final"
        assert (final / "export" / "pytorch_lora_weights.safetensors").is_file()
        pipe = StableDiffusionPipeline.from_pretrained(str(results / "prep" / "sd-model"), safety_checker=None)
        pipe.load_lora_weights(str(final / "export"))
        inputs = heldout_inputs(results / "prep" / "sd-data", FrozenEncoders(str(results / "prep" / "sd-model")),
                                runs[name]["spec"]["text_to_image"], FIXED_BATCH)
        pipe.unet.eval()
        with torch.no_grad():
            output = pipe.unet(inputs["noisy_latents"], inputs["timesteps"], inputs["encoder_hidden_states"]).sample
        saved = load_file(str(final / "eval_logits.safetensors"))["logits"]
        assert (output - saved).abs().max().item() <= 1e-5
        base = StableDiffusionPipeline.from_pretrained(str(results / "prep" / "sd-model"), safety_checker=None).unet
        with torch.no_grad():
            untouched = base.eval()(inputs["noisy_latents"], inputs["timesteps"],
                                    inputs["encoder_hidden_states"]).sample
        assert (untouched - saved).abs().max().item() > 1e-4  # the LoRA changed the output: the check can fail


@pytest.mark.slow
def test_checkpoint_validation_of_a_lora_unet_passes_export_reload_resume_and_reshard(workflow):
    from distlab.jobs.validate import validate_run

    results, _ = workflow
    run_dir = results / MACHINE / "accelerate-lora-w1-mb2-ga1-sd"
    result = validate_run(run_dir, str(results / "prep" / "sd-model"), str(results / "prep" / "sd-data"),
                          run_dir / "validation.json", log_path=str(run_dir / "validate.log"))
    checks = result["checks"]
    assert result["passed"], result
    assert checks["export"]["max_abs_output_diff"] <= 1e-5 and checks["export"]["generated_image_size"] == [32, 32]
    assert checks["resume_parity"]["steps_resumed"] == 2 and checks["reshard"]["to_world_size"] == 2
    assert checks["lora_base_frozen"]["identical"]


@pytest.mark.slow
def test_report_shows_the_sd_card_and_a_browser_decodes_its_sample_grid(workflow):
    import html as html_lib
    import re

    import test_browser as browser

    results, _ = workflow
    page = results / "report" / "index.html"
    html = page.read_text()
    assert "Stable Diffusion LoRA with Accelerate" in html and "base (top) vs tuned (bottom)" in html
    assert "images/s" in html and "held-out base -&gt; tuned" in html and "peak through save MiB/rank" in html
    # The advisor sized SD 1.5, SDXL and FLUX.1 from their configs (the published parameter counts).
    advice = json.loads((results / MACHINE / "advice-sd.json").read_text())
    counts = {m["model"]: m["denoiser_params"] for m in advice["models"]}
    assert counts["Stable Diffusion 1.5"] == 859_520_964 and counts["SDXL"] == 2_567_463_684
    assert counts["FLUX.1"] == 11_901_408_320 and "Advisor for text-to-image LoRA" in html
    memory = {m["model"]: m["activation_bytes"] for m in advice["models"]}
    assert 0 < memory["Stable Diffusion 1.5"] < memory["SDXL"] < memory["FLUX.1"]
    probed = page.with_name("probed-copy.html")
    probed.write_text(html.replace("<head>", "<head>" + browser.PROBE, 1))
    try:
        proc = browser.chromium("--virtual-time-budget=10000", "--dump-dom", probed.as_uri())
    finally:
        probed.unlink()
    probe = json.loads(html_lib.unescape(re.search(r'<pre id="distlab-probe">(.*?)</pre>', proc.stdout, re.S).group(1)))
    assert probe["errors"] == []
    grids = [img for img in probe["images"] if "base (top) vs tuned (bottom)" in img["alt"]]
    assert len(grids) == 4 and all(img["ok"] and img["width"] > 100 for img in grids), probe["images"]


def test_strategies_loop_and_launchers_never_ask_which_task_they_run():
    """The task is its own axis: no task name and no `task` field read in these modules."""
    modules = [*sorted((REPO / "distlab" / "strategies").glob("*.py")), REPO / "distlab" / "rank" / "loop.py",
               *sorted((REPO / "distlab" / "launchers").glob("*.py")), REPO / "distlab" / "rank" / "worker.py"]
    for path in modules:
        text = path.read_text()
        for needle in ("text-to-image", "causal-lm", "text_to_image", 'spec["task"]', "spec.get(\"task\"", "spec.task"):
            assert needle not in text, f"{path.name} mentions {needle}"


@pytest.mark.slow
def test_a_v_prediction_scheduler_trains_against_the_velocity(workflow, tmp_path):
    """The example's target for v_prediction schedulers: v = sqrt(abar_t) * noise - sqrt(1 - abar_t) * latents."""
    import shutil

    from distlab.tasks.text_to_image.data import FrozenEncoders, sample_generator

    results, _ = workflow
    folder = tmp_path / "sd-v"
    shutil.copytree(results / "prep" / "sd-model", folder)
    config_file = folder / "scheduler" / "scheduler_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "prediction_type": "v_prediction"}))
    pixels, captions = torch.rand(2, 3, 32, 32) * 2 - 1, ["a handwritten digit one", "a handwritten digit two"]
    batches = {}
    for name, source in (("epsilon", results / "prep" / "sd-model"), ("v", folder)):
        batches[name] = FrozenEncoders(str(source)).encode(pixels, captions, [sample_generator(0, 0, i) for i in (0,
                                                                                                                  1)])
    eps, v = batches["epsilon"], batches["v"]
    assert torch.equal(eps["noisy_latents"], v["noisy_latents"])  # the same draws: only the target differs
    abar = FrozenEncoders(str(folder)).scheduler.alphas_cumprod[v["timesteps"]].view(-1, 1, 1, 1)
    noise = eps["target"]
    latents = (v["noisy_latents"] - (1 - abar).sqrt() * noise) / abar.sqrt()
    assert torch.allclose(v["target"], abar.sqrt() * noise - (1 - abar).sqrt() * latents, atol=1e-4)
    assert not torch.allclose(v["target"], noise, atol=1e-2)


@pytest.mark.slow
def test_the_sd_advisor_answers_as_the_roadmaps_home_lab_table_for_24_gib_gpus(workflow):
    """The roadmap: Stable Diffusion, data parallel is enough; FLUX may need model parallel. The
    sized models (advice-sd.json) re-answered for two 24 GiB cards (10% headroom)."""
    from distlab.tools.advisor_diffusion import GIB, per_device

    results, _ = workflow
    advice = json.loads((results / MACHINE / "advice-sd.json").read_text())
    picks = {m["model"]: per_device(m, 2, 0.9 * 24 * GIB)["recommendation"] for m in advice["models"]}
    assert picks["Stable Diffusion 1.5"].startswith("data parallel") and picks["SDXL"].startswith("data parallel")
    assert not picks["FLUX.1"].startswith("data parallel"), picks
