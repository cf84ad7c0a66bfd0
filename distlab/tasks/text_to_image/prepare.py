"""The text-to-image task's prep rules: the embedded tiny Stable Diffusion (built offline from
configs, saved as a diffusers folder so that every run loads it through the real loading
code) and the image-caption data (the embedded default written as an imagefolder from
scikit-learn's digits, then read exactly like a user's folder)."""
from __future__ import annotations

import json
from pathlib import Path

DIGIT_NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
# Whole-word tokens of the built tokenizer (any other text is spelled out in byte tokens).
WORDS = ["a", "handwritten", "digit", *DIGIT_NAMES]
DIGIT_PIXELS = 64  # the 8x8 digits are stored upscaled; the run's transform resizes to its resolution


def clip_tokenizer(words: list[str]):
    """A CLIP BPE tokenizer from a vocabulary built here: every byte (as CLIP's byte-level
    alphabet, alone and word-final with </w>) plus one merge chain per word, so each listed word is
    one token. transformers builds CLIPTokenizer from (vocab, merges) without any download."""
    from transformers import CLIPTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = list(bytes_to_unicode().values())
    tokens = alphabet + [c + "</w>" for c in alphabet]
    merges = []
    for word in words:
        parts = list(word[:-1]) + [word[-1] + "</w>"]
        joined = parts[0]
        for part in parts[1:]:
            if (joined, part) not in merges:
                merges.append((joined, part))
            joined += part
            if joined not in tokens:
                tokens.append(joined)
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    return CLIPTokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, model_max_length=77)


def build_tiny_sd(build: dict, out_dir) -> dict:
    """diffusers' own tests' dummy Stable Diffusion (tests/pipelines/stable_diffusion
    get_dummy_components), sized by `build`, saved with StableDiffusionPipeline.save_pretrained."""
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    channels = list(build["block_out_channels"])
    cross = build["cross_attention_dim"]
    torch.manual_seed(build["seed"])
    unet = UNet2DConditionModel(block_out_channels=channels, layers_per_block=build["layers_per_block"],
                                sample_size=build["sample_size"], in_channels=4, out_channels=4,
                                down_block_types=("DownBlock2D",) + ("CrossAttnDownBlock2D",) * (len(channels) - 1),
                                up_block_types=("CrossAttnUpBlock2D",) * (len(channels) - 1) + ("UpBlock2D",),
                                cross_attention_dim=cross, norm_num_groups=build["norm_num_groups"])
    # DDIM for sampling, as the tests (steps_offset 1, the current convention); training reads
    # the same config as a DDPMScheduler, as the example does.
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
                              set_alpha_to_one=False, steps_offset=1)
    torch.manual_seed(build["seed"])
    vae = AutoencoderKL(block_out_channels=channels, in_channels=3, out_channels=3,
                        down_block_types=["DownEncoderBlock2D"] * len(channels),
                        up_block_types=["UpDecoderBlock2D"] * len(channels), latent_channels=4,
                        norm_num_groups=build["norm_num_groups"])
    tokenizer = clip_tokenizer(WORDS)
    torch.manual_seed(build["seed"])
    text_encoder = CLIPTextModel(CLIPTextConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        hidden_size=cross, intermediate_size=build["text_intermediate_size"], layer_norm_eps=1e-05,
        num_attention_heads=build["text_attention_heads"], num_hidden_layers=build["text_layers"],
        vocab_size=len(tokenizer), max_position_embeddings=tokenizer.model_max_length))
    pipe = StableDiffusionPipeline(unet=unet, scheduler=scheduler, vae=vae, text_encoder=text_encoder,
                                   tokenizer=tokenizer, safety_checker=None, feature_extractor=None,
                                   image_encoder=None, requires_safety_checker=False)
    pipe.save_pretrained(str(out_dir), safe_serialization=True)
    return {name: sum(p.numel() for p in module.parameters())
            for name, module in (("unet", unet), ("vae", vae), ("text_encoder", text_encoder))}


# -- data ------------------------------------------------------------------------------------
def write_digits_imagefolder(folder: Path, max_images: int | None) -> int:
    """scikit-learn's load_digits (1797 8x8 handwritten digits, shipped in the package: nothing
    downloaded) as an imagefolder: dark ink on white, upscaled bicubic to DIGIT_PIXELS, RGB, with
    metadata.jsonl captions "a handwritten digit <name>"."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    count = len(digits.images) if max_images is None else min(max_images, len(digits.images))
    images = folder / "train"
    images.mkdir(parents=True, exist_ok=True)
    with open(images / "metadata.jsonl", "w") as fh:
        for index in range(count):
            ink = (255 - digits.images[index] * 255 / 16).round().astype(np.uint8)
            image = Image.fromarray(ink, "L").resize((DIGIT_PIXELS, DIGIT_PIXELS), Image.Resampling.BICUBIC)
            image.convert("RGB").save(images / f"{index:04d}.png")
            fh.write(json.dumps({"file_name": f"{index:04d}.png",
                                 "text": f"a handwritten digit {DIGIT_NAMES[int(digits.target[index])]}"}) + "\n")
    return count


def load_rows(data: dict, scratch: Path):
    """The configured rows as one datasets.Dataset with columns image (datasets Image) and text."""
    import datasets

    if data["source"] in ("digits", "imagefolder"):
        folder = data["path"]
        if data["source"] == "digits":
            folder = scratch / "digits"
            write_digits_imagefolder(folder, data["max_images"])
        else:
            check_every_file_name(Path(folder))
        loaded = datasets.load_dataset("imagefolder", data_dir=str(folder), cache_dir=str(scratch / "cache"))
        rows = datasets.concatenate_datasets([loaded[split] for split in sorted(loaded)])
        image_column = "image"
    else:
        parts = []
        for name in data["files"]:
            builder = "parquet" if name.lower().endswith(".parquet") else "json"
            part = datasets.load_dataset(builder, data_files=[str(name)], split="train",
                                         cache_dir=str(scratch / "cache"))
            base = Path(name).parent
            column = data["image_column"]
            # Paths in the file are relative to it; bytes stay bytes (datasets' Image feature reads both).
            part = part.map(lambda row, index: {column: _image_value(within(name, index, row[column], base))},
                            with_indices=True, cache_file_name=str(scratch / f"resolved-{len(parts)}.arrow"))
            parts.append(part.cast_column(column, datasets.Image()))
        rows = datasets.concatenate_datasets(parts)
        image_column = data["image_column"]
    rows = rows.select_columns([image_column, data["caption_column"]])
    if image_column != "image":
        rows = rows.rename_column(image_column, "image")
    if data["caption_column"] != "text":
        rows = rows.rename_column(data["caption_column"], "text")
    if data["source"] != "digits" and data["max_images"] is not None:
        rows = rows.select(range(min(data["max_images"], len(rows))))
    return rows


def within(data_file, index: int, value, base: Path):
    """A row's image (image_source): config checked the first rows; this holds every row to
    the same rule, naming the file and row (a path out of the data file's folder is refused)."""
    from distlab.configuration.tasks.text_to_image.checks import OutsideDataFolder, image_source

    try:
        return image_source(value, base)
    except OutsideDataFolder as exc:
        raise OutsideDataFolder(f"config field 'text_to_image.data.files': {data_file}: row {index}: {exc}") from None


def check_every_file_name(folder: Path) -> None:
    """Every metadata.jsonl row of an imagefolder names a file inside it (config checked the
    first rows; datasets would read wherever file_name leads)."""
    from distlab.configuration.tasks.text_to_image.checks import OutsideDataFolder, image_source

    for metadata in sorted(folder.rglob("metadata.jsonl")):
        with open(metadata, encoding="utf-8") as fh:
            for line_no, line in enumerate(fh, 1):
                row = json.loads(line) if line.strip() else {}
                try:
                    image_source(row.get("file_name") if isinstance(row, dict) else None, metadata.parent, folder)
                except OutsideDataFolder as exc:
                    raise OutsideDataFolder(f"config field 'text_to_image.data.path': {metadata}:{line_no}: {exc}") \
                        from None


def _image_value(source) -> dict:
    return {"bytes": source, "path": None} if isinstance(source, bytes) else {"bytes": None, "path": str(source)}


def prepare_images(data: dict, out_dir) -> dict:
    """Rows -> a seeded held-out split of data.eval_images images -> save_to_disk (the image bytes
    are embedded: the run never reads the source folder again) + distlab_images.json."""
    import shutil
    import tempfile

    import datasets

    from distlab.tasks.text_to_image.data import INFO

    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory(dir=str(out_dir.parent)) as scratch:
        rows = load_rows(data, Path(scratch))
        if len(rows) <= data["eval_images"]:
            raise ValueError(f"config field 'text_to_image.data.eval_images': {data['eval_images']} held-out images "
                             f"leave none of the {len(rows)} to train on")
        split = rows.train_test_split(test_size=data["eval_images"], seed=data["seed"], shuffle=True)
        shutil.rmtree(out_dir, ignore_errors=True)
        datasets.DatasetDict({"train": split["train"], "eval": split["test"]}).save_to_disk(str(out_dir))
    info = {"source": data["source"], "path": data["path"], "files": data["files"],
            "image_column": data["image_column"], "caption_column": data["caption_column"],
            "splits": {"train": len(split["train"]), "eval": len(split["test"])}, "seed": data["seed"],
            "how": "datasets.load_dataset (imagefolder / parquet / json), train_test_split(test_size=eval_images, "
                   "seed), save_to_disk with the image bytes embedded"}
    (out_dir / INFO).write_text(json.dumps(info, indent=1))
    return info
