# The text-to-image task's prep (experiments with task text-to-image read these): the tiny
# Stable Diffusion the pipeline builds (unless text_to_image.model.path names a folder), the
# image-caption data with its held-out split, and the base UNet's held-out denoising loss.


rule build_sd_model:
    output:
        f"{PREP}/sd-model/model_index.json",
    log:
        f"{PREP}/logs/sd-model.log",
    conda:
        "../envs/train.yaml"
    resources:
        mem_mb=one_process_model_mem_mb(),
        runtime=15,  # builds and saves a tiny pipeline: seconds
    params:
        build=config["text_to_image"]["model"]["build"],
    script:
        "../scripts/build_sd_model.py"


rule prepare_images:
    output:
        directory(f"{PREP}/sd-data"),
    log:
        f"{PREP}/logs/sd-data.log",
    conda:
        "../envs/train.yaml"
    resources:
        # The rows (and their image bytes) of one dataset in one process.
        mem_mb=4000,
        runtime=30,
    params:
        data=config["text_to_image"]["data"],
    script:
        "../scripts/prepare_images.py"


rule evaluate_base_sd:
    input:
        data=f"{PREP}/sd-data",
        model=sd_model_inputs(),
    output:
        f"{PREP}/eval/sd-base.json",
    log:
        f"{PREP}/logs/eval-sd-base.log",
    conda:
        "../envs/train.yaml"
    resources:
        mem_mb=one_process_model_mem_mb(),
        runtime=15,  # one forward of the UNet over the held-out images
    params:
        # The held-out images pass through the runs' resize (center crop, no flip).
        settings={key: config["text_to_image"][key] for key in ("resolution", "center_crop", "interpolation")},
    script:
        "../scripts/evaluate_base_sd.py"


# The advisor for text-to-image LoRA: SD 1.5, SDXL, FLUX.1 and the configured SD folder sized
# from their configs (meta-device models, no weights) for this machine's devices.
rule advise_sd:
    input:
        hardware=f"{RESULTS}/{MACHINE}/hardware.json",
        model=sd_model_inputs(),
    output:
        f"{RESULTS}/{MACHINE}/advice-sd.json",
    log:
        f"{RESULTS}/{MACHINE}/logs/advise-sd.log",
    conda:
        "../envs/train.yaml"
    resources:
        # Meta-device models (no weights): the libraries' import and the Python objects only.
        mem_mb=2000,
        runtime=10,
    params:
        advisor=config["advisor"],
        resolution=config["text_to_image"]["resolution"],
        cpu_ranks=max(spec.world_size for spec in SPECS.values()),
    script:
        "../scripts/advise_sd.py"
