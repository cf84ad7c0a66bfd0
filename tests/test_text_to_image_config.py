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


def test_an_image_too_long_for_its_width_is_refused_before_any_job_naming_it(tmp_path):
    """A valid 1x100000 PNG (a few hundred bytes) would want ~100 GB per rank resized to 512 px."""
    stages = {"ddp": {"experiments": [SD]}}
    good = {"file_name": "good.png", "text": "a white square"}
    folder = image_folder(tmp_path, [good, {"file_name": "sliver.png", "text": "a sliver"}])
    Image.new("1", (1, 100_000)).save(folder / "sliver.png")
    assert (folder / "sliver.png").stat().st_size < 2000
    message = refusal(stages, text_to_image={"data": {"source": "imagefolder", "path": str(folder)}})
    assert "text_to_image.data.path" in message and f"{folder / 'metadata.jsonl'}:2" in message
    assert str(folder / "sliver.png") in message and "1x100000" in message and "aspect ratio" in message


def test_a_huge_image_is_refused_from_its_header_without_decoding_its_pixels(tmp_path, monkeypatch):
    """12000x12000 pixels (a small file): refused from the size in its header at every
    snakemake call (`-n` too), its pixels never decoded."""
    from PIL import ImageFile

    stages = {"ddp": {"experiments": [SD]}}
    folder = image_folder(tmp_path, [{"file_name": "good.png", "text": "a white square"},
                                     {"file_name": "huge.png", "text": "a lot of white"}])
    Image.new("1", (12_000, 12_000), 1).save(folder / "huge.png")

    def decoded(self):
        raise AssertionError(f"the config check decoded {self.size} pixels")

    monkeypatch.setattr(ImageFile.ImageFile, "load", decoded)
    message = refusal(stages, text_to_image={"data": {"source": "imagefolder", "path": str(folder)}})
    assert f"{folder / 'metadata.jsonl'}:2" in message and "12000x12000" in message and "MAX_IMAGE_PIXELS" in message
    (folder / "metadata.jsonl").write_text(json.dumps({"file_name": "good.png", "text": "a white square"}) + "\n")
    specs_of(stages, text_to_image={"data": {"source": "imagefolder", "path": str(folder)}})  # never decoded either


def test_a_row_cannot_name_an_image_outside_its_data_folder(tmp_path):
    """Data prep embeds every row's image into results/prep: a row naming '../' or an absolute
    path, or a symlink out of the folder, would copy any file the user can read there."""
    stages = {"ddp": {"experiments": [SD]}}
    secret = tmp_path / "secret.png"
    Image.new("RGB", (16, 16), "black").save(secret)
    data = tmp_path / "data"
    data.mkdir()
    for value in ("../secret.png", str(secret)):
        (data / "rows.jsonl").write_text(json.dumps({"image": value, "text": "a black square"}) + "\n")
        message = refusal(stages, text_to_image={"data": {"source": "files", "files": [str(data / "rows.jsonl")]}})
        assert "text_to_image.data.files[0]" in message and f"{data / 'rows.jsonl'}:1" in message
        assert "outside" in message and str(data) in message
    (data / "link.png").symlink_to(secret)
    (data / "rows.jsonl").write_text(json.dumps({"image": "link.png", "text": "a black square"}) + "\n")
    assert "outside" in refusal(stages, text_to_image={"data": {"source": "files",
                                                                "files": [str(data / "rows.jsonl")]}})
    folder = image_folder(tmp_path, [{"file_name": "../secret.png", "text": "a black square"}])
    message = refusal(stages, text_to_image={"data": {"source": "imagefolder", "path": str(folder)}})
    assert f"{folder / 'metadata.jsonl'}:1" in message and "outside" in message


def test_rows_past_the_checked_ones_are_held_to_the_folder_and_cropped_before_resizing(tmp_path, monkeypatch):
    """Config checks the first rows of a file; data prep holds every row to its folder, and
    training cuts an over-long image to MAX_ASPECT before it resizes anything."""
    import numpy as np
    import torch

    from distlab.configuration.tasks.text_to_image.checks import MAX_ASPECT, OutsideDataFolder
    from distlab.tasks.text_to_image.data import sample_generator, transform
    from distlab.tasks.text_to_image.prepare import check_every_file_name

    folder = image_folder(tmp_path, [{"file_name": "good.png", "text": "ok"}] * 3
                          + [{"file_name": "../../etc/passwd", "text": "not an image"}])
    with pytest.raises(OutsideDataFolder, match=rf"{folder / 'metadata.jsonl'}:4.*outside"):
        check_every_file_name(folder)

    requested = []
    real_resize = Image.Image.resize

    def resize(self, size, *args, **kwargs):
        requested.append(size)
        assert size[0] * size[1] <= MAX_ASPECT * 16 * 16, f"resize to {size}"
        return real_resize(self, size, *args, **kwargs)

    monkeypatch.setattr(Image.Image, "resize", resize)
    sliver = Image.fromarray(np.arange(100_000, dtype=np.uint32).reshape(100_000, 1).astype(np.uint8))
    settings = {"resolution": 16, "interpolation": "nearest", "center_crop": True, "random_flip": False}
    pixels = transform(sliver, settings, sample_generator(0, 0, 0), train=True)
    assert pixels.shape == (3, 16, 16) and requested == [(16, 64)]
    assert torch.isfinite(pixels).all()


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

    def as_pixels(img):
        return torch.from_numpy(np.asarray(img, dtype=np.float32) / 127.5 - 1).permute(2, 0, 1)

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
