#!/usr/bin/env bash
# Wheels for the GPU check kit: the packages distlab needs that the GPU machine's image
# lacks (it has torch, transformers, peft, accelerate, pandas, matplotlib, pynvml, but no
# snakemake, datasets or deepspeed and no network). Run here, where pip works:
#   bash benchmarks/gpu_wheels.sh      -> .whl/ (git-ignored), carried with the working tree
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir -p .whl
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux1_x86_64)
# 1. Wheels of everything, built or fetched for this Python (some deps are sdist-only).
python3 -m pip wheel -q -w .whl "snakemake==9.27.1" "datasets==5.2.0" "jsonschema==4.26.0" "pydantic>=2" hjson
# deepspeed alone, without its torch requirement (the GPU image's torch is the one to use).
DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation -w .whl "deepspeed==0.19.8"
# 2. Compiled wheels are per Python version: swap each for its cp312 build (the GPU image's Python).
for whl in .whl/*-cp3[0-9]*-*.whl .whl/*-py3[0-9]*-none-*.whl; do
  [ -e "$whl" ] || continue
  base=$(basename "$whl"); name=${base%%-*}; ver=$(echo "$base" | cut -d- -f2)
  rm -f "$whl"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLAT[@]}" -d .whl "$name==$ver"
done
# Drop what the GPU image already has (its list: .library/device/README.md), so that its
# own builds of torch, numpy, pyarrow ... are used and the carry stays small.
for have in torch numpy pyarrow pandas fsspec huggingface_hub requests urllib3 certifi idna charset_normalizer \
            tqdm pyyaml PyYAML packaging filelock aiohttp aiosignal frozenlist multidict yarl propcache \
            aiohappyeyeballs attrs jinja2 MarkupSafe psutil tabulate wrapt xxhash typing_extensions \
            hf_xet httpx httpcore h11 anyio sniffio click rich pygments markdown_it_py mdurl shellingham typer \
            platformdirs msgpack ninja py_cpuinfo einops annotated_doc networkx mpmath sympy triton setuptools \
            nvidia_ml_py safetensors regex tokenizers six python_dateutil pytz tzdata; do
  rm -f .whl/"$have"-[0-9]*.whl
done
rm -f .whl/nvidia_*.whl .whl/cuda_*.whl
du -sh .whl && ls .whl | wc -l
