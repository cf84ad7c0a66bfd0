"""Rule prepare_images: image-caption rows -> a seeded held-out split, saved as Arrow (image bytes embedded)."""
from distlab.jobs.rule_log import logged
from distlab.tasks.text_to_image.prepare import prepare_images

with logged(snakemake):
    info = prepare_images(dict(snakemake.params.data), snakemake.output[0])
    print(f"images from {info['source']}: {info['splits']['train']} train, {info['splits']['eval']} held out")
