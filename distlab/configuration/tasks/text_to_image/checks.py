"""Config-time checks of the text-to-image task's inputs, before any job starts: the model
folder (a diffusers Stable Diffusion folder as StableDiffusionPipeline.save_pretrained writes
it and a download looks) and the image-caption data (an imagefolder with metadata.jsonl, or
Parquet / JSON lines with an image column). Every error names the config field and the file
(and the row). Light: json, pyarrow and PIL only (the Snakefile imports this at parse time).
"""
from __future__ import annotations

import io
import json
from pathlib import Path

from distlab.configuration.input_checks import ConfigError

SAMPLE_ROWS = 200  # rows per metadata/data file whose image and caption are checked
# The longest side an image may have per pixel of its shorter side: config refuses beyond it,
# and training crops the rows it did not check to it before resizing (data.transform).
MAX_ASPECT = 4.0
PIPELINE_CLASS = "StableDiffusionPipeline"
# component folder -> what must be in it (any one of each tuple)
COMPONENTS = {
    "unet": (("config.json",), ("*.safetensors",)),
    "vae": (("config.json",), ("*.safetensors",)),
    "text_encoder": (("config.json",), ("*.safetensors",)),
    "tokenizer": (("tokenizer.json", "vocab.json"),),
    "scheduler": (("scheduler_config.json",),),
}


def _fail(where: str, message: str):
    raise ConfigError(f"config field '{where}': {message}")


def check_model_folder(folder, where: str = "text_to_image.model.path") -> None:
    """A Stable Diffusion (1.x/2.x) diffusers folder with safetensors weights: model_index.json
    naming StableDiffusionPipeline and the five components the task loads, each with its files."""
    folder = Path(folder)
    if not folder.is_dir():
        _fail(where, f"model folder '{folder}' does not exist")
    index = folder / "model_index.json"
    if not index.is_file():
        _fail(where, f"'{folder}' has no model_index.json (not a diffusers pipeline folder: "
                     "StableDiffusionPipeline.save_pretrained writes one)")
    try:
        meta = json.loads(index.read_text())
    except (OSError, ValueError) as exc:
        _fail(where, f"{index}: unreadable JSON ({exc})")
    if meta.get("_class_name") != PIPELINE_CLASS:
        _fail(where, f"{index}: _class_name {meta.get('_class_name')!r}; the text-to-image task trains "
                     f"{PIPELINE_CLASS} folders (SD 1.x/2.x: one text encoder; SDXL and FLUX pipelines have "
                     "other components and are sized by the advisor only)")
    for component, needs in COMPONENTS.items():
        sub = folder / component
        if component not in meta or not sub.is_dir():
            _fail(where, f"'{folder}' has no {component}/ folder (model_index.json lists "
                         f"{sorted(k for k in meta if not k.startswith('_'))})")
        for choices in needs:
            if not any(list(sub.glob(pattern)) for pattern in choices):
                why = " (.bin weights are not loaded: distlab never unpickles a checkpoint)" \
                    if choices == ("*.safetensors",) else ""
                _fail(where, f"{sub} has no {' or '.join(choices)}{why}")
        config = sub / "config.json"
        if config.is_file():
            try:
                json.loads(config.read_text())
            except ValueError as exc:
                _fail(where, f"{config}: unreadable JSON ({exc})")


# -- data ------------------------------------------------------------------------------------
def _caption_ok(value) -> bool:
    if isinstance(value, str):
        return bool(value.strip())
    return isinstance(value, list) and bool(value) and all(isinstance(v, str) for v in value)


def shape_problem(size: tuple[int, int], resolution: int) -> str | None:
    """Why an image of `size` (width, height) cannot be trained on at `resolution`, or None:
    too long for its width (the transform would crop away all but a sliver, and the resize of
    the shorter side to `resolution` would make the longer one resolution x aspect pixels: a
    1x100000 image at 512 px wants ~100 GB), or too many pixels to decode (PIL's own
    decompression-bomb bound, Image.MAX_IMAGE_PIXELS)."""
    from PIL import Image

    width, height = size
    if width < 1 or height < 1:
        return f"{width}x{height} pixels: an empty image"
    aspect = max(width, height) / min(width, height)
    if aspect > MAX_ASPECT:
        return (f"{width}x{height} pixels: aspect ratio {aspect:,.0f}:1, beyond the {MAX_ASPECT:g}:1 the task trains "
                f"on (resized to {resolution} px on its shorter side it would be "
                f"{int(resolution * aspect):,} px long); crop it, or leave it out")
    if Image.MAX_IMAGE_PIXELS and width * height > Image.MAX_IMAGE_PIXELS:
        return (f"{width}x{height} pixels: {width * height / 1e6:,.0f} megapixels to decode, beyond PIL's bound of "
                f"{Image.MAX_IMAGE_PIXELS / 1e6:,.0f} (Image.MAX_IMAGE_PIXELS); scale it down to about "
                f"{resolution} px first")
    return None


def _open_image(source, resolution: int, where: str, at: str) -> None:
    """source: a path or bytes. Its header (size, mode) and structure (PIL's verify: a PNG's
    chunks and checksums, a truncated file fails) are read; no pixel is decoded (the Snakefile,
    `-n` too, runs this at every call)."""
    import warnings

    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # shape_problem says it
            with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as image:
                size = image.size
                image.verify()
    except Image.DecompressionBombError as exc:
        _fail(where, f"{at}: {exc}")
    except Exception as exc:  # PIL raises many kinds: each means "not an image we can train on"
        _fail(where, f"{at}: unreadable image ({type(exc).__name__}: {exc})")
    problem = shape_problem(size, resolution)
    if problem:
        _fail(where, f"{at}: image {source if isinstance(source, Path) else '(bytes)'} of {problem}")


class OutsideDataFolder(ValueError):
    """A row's image path that leads out of the folder the config names."""


def image_source(value, base: Path, root: Path | None = None):
    """What a row's image field points at: bytes, or a path (relative to the data file's folder
    `base`), which must lie inside `root` (default `base`) once every symlink is resolved: a
    row must not make data prep copy any file the user can read into results/prep.
    None when the value is neither (the caller names the row)."""
    if isinstance(value, dict):
        if value.get("bytes"):
            return value["bytes"]
        value = value.get("path")
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, str) and value:
        folder = Path(root or base).resolve()
        path = (Path(base) / value).resolve()
        if not path.is_relative_to(folder):
            raise OutsideDataFolder(f"image path {value!r} leads to {path}, outside {folder}: a row names an image "
                                    "in the folder of its data file (or below it)")
        return path
    return None


def _check_row(row, image_key: str, caption: str, base: Path, where: str, at: str, resolution: int,
               root: Path | None = None) -> None:
    if not isinstance(row, dict):
        _fail(where, f"{at}: a row must be an object, found {type(row).__name__}")
    if image_key not in row:
        _fail(where, f"{at}: no field '{image_key}' (row has {sorted(row)[:8]})")
    if caption not in row or not _caption_ok(row[caption]):
        _fail(where, f"{at}: no caption: field '{caption}' must be non-empty text or a list of texts "
                     "(text_to_image.data.caption_column names it)")
    try:
        source = image_source(row[image_key], base, root)
    except OutsideDataFolder as exc:
        _fail(where, f"{at}: {exc}")
    if source is None:
        _fail(where, f"{at}: field '{image_key}' is neither a path nor image bytes")
    if isinstance(source, Path) and not source.is_file():
        _fail(where, f"{at}: image file '{source}' does not exist")
    _open_image(source, resolution, where, at)


def _json_rows(path: Path, where: str):
    with open(path, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                yield line_no, json.loads(line)
            except ValueError as exc:
                _fail(where, f"{path}:{line_no}: not a JSON line ({exc})")


def check_imagefolder(folder, caption: str, where: str, resolution: int) -> None:
    """datasets' imagefolder layout: images with a metadata.jsonl beside them (in the folder or
    in split subfolders) whose rows hold file_name and the caption column."""
    folder = Path(folder)
    if not folder.is_dir():
        _fail(where, f"image folder '{folder}' does not exist")
    metadata = sorted(folder.rglob("metadata.jsonl"))
    if not metadata:
        _fail(where, f"'{folder}' has no metadata.jsonl (one JSON line per image: "
                     f'{{"file_name": "0001.png", "{caption}": "a caption"}})')
    for path in metadata:
        seen = 0
        for line_no, row in _json_rows(path, where):
            _check_row(row, "file_name", caption, path.parent, where, f"{path}:{line_no}", resolution, folder)
            seen += 1
            if seen >= SAMPLE_ROWS:
                break
        if not seen:
            _fail(where, f"{path}: no rows")


def check_image_file(name: str, image_column: str, caption: str, where: str, resolution: int) -> None:
    """A Parquet or JSON lines file of rows with an image column (bytes or a path relative to
    the file) and a caption column."""
    path = Path(name)
    if not path.is_file():
        _fail(where, f"file '{name}' does not exist")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.ParquetFile(path).read_row_group(0).slice(0, SAMPLE_ROWS).to_pylist()
        except Exception as exc:
            _fail(where, f"{path}: not a readable Parquet file ({exc})")
        if not rows:
            _fail(where, f"{path}: Parquet file holds no rows")
        for index, row in enumerate(rows):
            _check_row(row, image_column, caption, path.parent, where, f"{path}: row {index}", resolution)
        return
    if suffix not in (".jsonl", ".json"):
        _fail(where, f"{path}: image-caption rows are read from .parquet or .jsonl files")
    seen = 0
    for line_no, row in _json_rows(path, where):
        _check_row(row, image_column, caption, path.parent, where, f"{path}:{line_no}", resolution)
        seen += 1
        if seen >= SAMPLE_ROWS:
            break
    if not seen:
        _fail(where, f"{path}: no rows")


def check_data(data: dict, resolution: int, where: str = "text_to_image.data") -> None:
    """The configured image-caption rows (the first SAMPLE_ROWS of each file): captions, and
    images that read, lie in the configured folder and can be trained on at `resolution`."""
    if data["source"] == "imagefolder":
        if not data["path"]:
            _fail(f"{where}.path", "source 'imagefolder' needs the folder")
        check_imagefolder(data["path"], data["caption_column"], f"{where}.path", resolution)
    elif data["source"] == "files":
        if not data["files"]:
            _fail(f"{where}.files", "source 'files' needs at least one .parquet or .jsonl file")
        for index, name in enumerate(data["files"]):
            check_image_file(name, data["image_column"], data["caption_column"], f"{where}.files[{index}]",
                             resolution)


def check_shapes(block: dict) -> None:
    """The built model's group norms and heads divide its widths, and the resolution survives the
    VAE's and the UNet's downsampling (read from the folder's configs when model.path is set)."""
    model = block["model"]
    if model.get("path"):
        vae = json.loads((Path(model["path"]) / "vae" / "config.json").read_text())
        unet = json.loads((Path(model["path"]) / "unet" / "config.json").read_text())
        vae_blocks, unet_blocks = len(vae.get("block_out_channels", [0])), len(unet.get("block_out_channels", [0]))
    else:
        build = model["build"]
        where = "text_to_image.model.build"
        for channels in build["block_out_channels"]:
            if channels % build["norm_num_groups"]:
                _fail(f"{where}.norm_num_groups", f"{build['norm_num_groups']} groups do not divide "
                                                  f"{channels} channels (block_out_channels)")
        if build["cross_attention_dim"] % build["text_attention_heads"]:
            _fail(f"{where}.text_attention_heads", f"{build['text_attention_heads']} heads do not divide "
                                                   f"cross_attention_dim {build['cross_attention_dim']}")
        vae_blocks = unet_blocks = len(build["block_out_channels"])
    multiple = 2 ** (vae_blocks - 1) * 2 ** (unet_blocks - 1)
    if block["resolution"] % multiple:
        _fail("text_to_image.resolution", f"{block['resolution']} px is not a multiple of {multiple} (the VAE "
                                          f"halves it {vae_blocks - 1} time(s), then the UNet {unet_blocks - 1})")
