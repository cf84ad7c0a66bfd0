"""The text-to-image task at config time: what it refuses (naming the field, the file and the
row) before any job starts, and what a resolved experiment carries. No model is built here."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from conftest import REPO, tiny_config
from distlab.configuration.config import load, load_file
from distlab.configuration.input_checks import ConfigError

SD = {"task": "text-to-image", "method": "lora"}


def specs_of(stages: dict, **blocks) -> dict:
    cfg = tiny_config(stages)
    cfg.update(blocks)
    return load(cfg, gpu_count=0)[1]


def refusal(stages: dict, **blocks) -> str:
    with pytest.raises(ConfigError) as caught:
        specs_of(stages, **blocks)
    return str(caught.value)


def test_tensor_and_pipeline_parallel_are_refused_naming_why():
    tp = refusal({"parallel": {"experiments": [{**SD, "strategy": "tp", "world_size": 2}]}})
    assert "stages.parallel.experiments[0].strategy" in tp and "base_model_tp_plan" in tp
    pp = refusal({"parallel": {"experiments": [{**SD, "strategy": "pp", "world_size": 2}]}})
    assert "stages.parallel.experiments[0].strategy" in pp and "skip connections" in pp


def test_deepspeed_nvme_parameter_offload_is_refused_by_the_deepspeed_settings_naming_the_field():
    nvme = {"zero_stage": 3, "offload_param": "nvme", "nvme_path": "/tmp/nvme"}
    message = refusal({"deepspeed": {"experiments": [{**SD, "strategy": "deepspeed", "deepspeed": nvme}]}})
    assert "experiments[0].deepspeed.offload_param" in message and "NVMe parameter offload" in message


def test_full_fine_tuning_ray_and_causal_lm_fields_are_refused_naming_the_field():
    assert "experiments[0].method" in refusal({"ddp": {"experiments": [{**SD, "method": "full"}]}})
    assert "experiments[0].launcher" in refusal({"ddp": {"experiments": [{**SD, "launcher": "ray"}]}})
    assert "experiments[0].dataset" in refusal({"ddp": {"experiments": [{**SD, "dataset": "x"}]}},
                                                data={**tiny_config({})["data"], "extra": {"x": {}}})


def test_a_text_to_image_experiment_gets_its_own_id_settings_and_the_examples_lora_targets():
    specs = specs_of({"accelerate": {"experiments": [{**SD, "strategy": "accelerate"}, {"strategy": "accelerate"}]}})
    sd, lm = specs["accelerate-lora-w1-mb4-ga1-sd"], specs["accelerate-full-w1-mb4-ga1"]
    assert sd["lora"]["target_modules"] == ["to_k", "to_q", "to_v", "to_out.0"]
    assert sd["text_to_image"]["resolution"] == 32 and "text_to_image" not in lm and lm["task"] == "causal-lm"


def test_the_default_run_has_one_sd_accelerate_pair_beside_the_causal_lm_runs():
    specs = load_file(REPO / "config" / "config.yaml", gpu_count=0)[1]
    sd = {k: s for k, s in specs.items() if s["task"] == "text-to-image"}
    assert sorted(sd) == ["accelerate-lora-w1-mb4-ga1-sd", "accelerate-lora-w2-mb4-ga1-sd"]
    assert "accelerate-lora-w1-mb4-ga1" in specs  # the causal-LM pair keeps its ids


def model_folder(root: Path) -> Path:
    """The file layout of StableDiffusionPipeline.save_pretrained (contents are not read here)."""
    folder = root / "sd"
    (folder / "model_index.json").parent.mkdir(parents=True)
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline", **{
        k: ["x", "y"] for k in ("unet", "vae", "text_encoder", "tokenizer", "scheduler")}}))
    for part in ("unet", "vae", "text_encoder"):
        (folder / part).mkdir()
        (folder / part / "config.json").write_text(json.dumps({"block_out_channels": [4, 8]}))
        (folder / part / "diffusion_pytorch_model.safetensors").write_bytes(b"")
    (folder / "tokenizer").mkdir()
    (folder / "tokenizer" / "tokenizer.json").write_text("{}")
    (folder / "scheduler").mkdir()
    (folder / "scheduler" / "scheduler_config.json").write_text("{}")
    return folder


def test_a_model_folder_that_is_not_a_stable_diffusion_folder_is_refused_naming_the_file(tmp_path):
    folder = model_folder(tmp_path)
    stages = {"ddp": {"experiments": [SD]}}
    specs_of(stages, text_to_image={"model": {"path": str(folder)}})  # the layout is accepted
    (folder / "unet" / "diffusion_pytorch_model.safetensors").rename(folder / "unet" / "diffusion_pytorch_model.bin")
    message = refusal(stages, text_to_image={"model": {"path": str(folder)}})
    assert "text_to_image.model.path" in message and str(folder / "unet") in message and ".bin" in message
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    assert "FluxPipeline" in refusal(stages, text_to_image={"model": {"path": str(folder)}})
    assert "does not exist" in refusal(stages, text_to_image={"model": {"path": str(tmp_path / "none")}})


def image_folder(root: Path, rows: list[dict]) -> Path:
    folder = root / "images"
    folder.mkdir()
    Image.new("RGB", (16, 16), "white").save(folder / "good.png")
    (folder / "metadata.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder


def test_unreadable_images_and_missing_captions_are_refused_naming_file_and_row(tmp_path):
    stages = {"ddp": {"experiments": [SD]}}
    good = {"file_name": "good.png", "text": "a white square"}
    folder = image_folder(tmp_path, [good, good, {"file_name": "good.png", "caption": "wrong column"}])
    message = refusal(stages, text_to_image={"data": {"source": "imagefolder", "path": str(folder)}})
    assert f"{folder / 'metadata.jsonl'}:3" in message and "no caption" in message
    (folder / "metadata.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(
        {"file_name": "broken.png", "text": "half a file"}) + "\n")
    (folder / "broken.png").write_bytes((folder / "good.png").read_bytes()[:40])
    message = refusal(stages, text_to_image={"data": {"source": "imagefolder", "path": str(folder)}})
    assert f"{folder / 'metadata.jsonl'}:2" in message and "unreadable image" in message
    (folder / "broken.png").unlink()
    assert "does not exist" in refusal(stages, text_to_image={"data": {"source": "imagefolder", "path": str(folder)}})


def test_parquet_and_json_lines_rows_need_their_image_and_caption_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    stages = {"ddp": {"experiments": [SD]}}
    png = image_folder(tmp_path, []) / "good.png"
    table = pa.table({"picture": [{"bytes": png.read_bytes(), "path": None}], "text": ["a white square"]})
    pq.write_table(table, tmp_path / "rows.parquet")
    files = {"source": "files", "files": [str(tmp_path / "rows.parquet")]}
    message = refusal(stages, text_to_image={"data": files})
    assert "text_to_image.data.files[0]" in message and "row 0" in message and "no field 'image'" in message
    specs_of(stages, text_to_image={"data": {**files, "image_column": "picture"}})
    (tmp_path / "rows.jsonl").write_text(json.dumps({"image": "images/good.png", "text": ["two", "captions"]}) + "\n")
    specs_of(stages, text_to_image={"data": {"source": "files", "files": [str(tmp_path / "rows.jsonl")]}})


def test_a_resolution_the_vae_and_unet_cannot_halve_is_refused():
    message = refusal({"ddp": {"experiments": [SD]}}, text_to_image={"resolution": 30})
    assert "text_to_image.resolution" in message and "multiple of 4" in message


def test_images_are_resized_by_the_shorter_side_cropped_and_flipped_as_the_example_does():
    """torchvision's arithmetic, written out: Resize(16) of 40x20 -> 32x16; CenterCrop offset 8;
    RandomCrop offsets in [0, 16]; RandomHorizontalFlip after the crop; eval: center, never flipped."""
    import numpy as np
    import torch

    from distlab.tasks.text_to_image.data import sample_generator, transform

    ramp = Image.fromarray(np.tile(np.arange(40, dtype=np.uint8) * 6, (20, 1))).convert("RGB")  # column = shade
    settings = {"resolution": 16, "interpolation": "nearest", "center_crop": True, "random_flip": False}
    as_pixels = lambda img: torch.from_numpy(np.asarray(img, dtype=np.float32) / 127.5 - 1).permute(2, 0, 1)
    resized = ramp.resize((32, 16), Image.Resampling.NEAREST)
    centre = transform(ramp, settings, sample_generator(0, 0, 0), train=True)
    assert centre.shape == (3, 16, 16) and torch.allclose(centre, as_pixels(resized.crop((8, 0, 24, 16))), atol=1e-6)
    settings.update(center_crop=False)
    offsets, flips = set(), set()
    for index in range(12):
        crop = transform(ramp, settings, sample_generator(0, 0, index), train=True)
        left = [x for x in range(17) if torch.allclose(crop, as_pixels(resized.crop((x, 0, x + 16, 16))), atol=1e-6)]
        assert len(left) == 1, index
        offsets.add(left[0])
        flipped = transform(ramp, {**settings, "random_flip": True}, sample_generator(0, 0, index), train=True)
        assert torch.equal(flipped, crop) or torch.equal(flipped, crop.flip(-1)), index
        flips.add(not torch.equal(flipped, crop))
        # Held-out images: the centre crop, never flipped, whatever the settings.
        assert torch.equal(transform(ramp, {**settings, "random_flip": True}, sample_generator(0, 0, index), False),
                           centre)
    assert flips == {True, False} and len(offsets) > 3  # crops and flips vary by sample
