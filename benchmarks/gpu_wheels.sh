#!/usr/bin/env bash
# Wheels for the GPU check kit: every package the kit's jobs need that the GPU box's image
# lacks (snakemake, datasets, jsonschema, deepspeed and all of their own requirements:
# platformdirs, connection_pool, pulp, ...), for the box's Python, WITHOUT torch (the box's
# CUDA torch is the one to use). Run where pip reaches a package index:
#
#   bash benchmarks/gpu_wheels.sh                -> .whl/ (git-ignored), carried to the box
#
# Settings (environment variables):
#   PYTHON_VERSION  the target interpreter, e.g. 3.12 (default: the box's, 3.12)
#   PLATFORMS       space-separated wheel platforms (default: manylinux x86_64 tags)
#   DISTLAB_WHEEL_DEST   the wheel folder to fill (default: .whl)
#   DISTLAB_WHEEL_CACHE  where the whole closure is built once and reused (default: build/wheel-cache/py<ver>)
#   KEEP_BOX=1      keep the packages the box already has (a clean venv needs them: the test)
#
# The script deletes only what it made: its two folders carry a stamp file (.inputs in the
# cache, .distlab-wheels in the wheel folder); a folder that exists, is not empty and has no
# stamp is refused before anything runs (generic names like CACHE or DEST, which CI systems
# and dotfiles export, are not read).
#
# How: `pip wheel` builds or fetches a wheel of every requirement and dependency for the
# interpreter running this script (some, like connection_pool, are sdist-only: built here
# as pure-Python wheels); each compiled wheel is then swapped for the target version's
# build. deepspeed is built with --no-deps (its torch requirement must not pull a torch);
# its other requirements are named below. Ray is not in the set: the kit runs no Ray
# experiment and distlab imports ray only in its Ray launcher (and ray[train] alone is
# ~70 MB, over what one device call may carry with the rest).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
HERE_VERSION=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
PYTHON_VERSION=${PYTHON_VERSION:-3.12}
PLATFORMS=${PLATFORMS:-"manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64"}
DEST=${DISTLAB_WHEEL_DEST:-.whl}
CACHE=${DISTLAB_WHEEL_CACHE:-build/wheel-cache/py$PYTHON_VERSION}
KEEP_BOX=${KEEP_BOX:-0}
DEST_STAMP=.distlab-wheels

# Refuse a folder this script did not make: it exists, holds something, and has no stamp.
refuse_foreign() {  # <folder> <stamp> <variable>
  if [ -d "$1" ] && [ -n "$(ls -A "$1")" ] && [ ! -e "$1/$2" ]; then
    echo "gpu_wheels: refusing $3=$1: it holds files this script did not make (no $2 stamp); name an empty or new folder" >&2
    exit 2
  fi
  if [ -e "$1" ] && [ ! -d "$1" ]; then
    echo "gpu_wheels: refusing $3=$1: not a folder" >&2
    exit 2
  fi
}
refuse_foreign "$CACHE" .inputs DISTLAB_WHEEL_CACHE
refuse_foreign "$DEST" "$DEST_STAMP" DISTLAB_WHEEL_DEST

# The kit's package set beyond torch (versions: those distlab is tested with). threadpoolctl
# (a warm-started CPU rank sets OpenBLAS's threads with it) is on the box already: it joins the
# set so that the CPU rehearsal's box venv has it too, and is not carried.
REQUIREMENTS=("snakemake==9.27.1" "datasets==5.2.0" "jsonschema==4.26.0" "platformdirs==4.14.9"
              "threadpoolctl==3.8.0")
DEEPSPEED="deepspeed==0.19.8"
DEEPSPEED_DEPS=("hjson==3.1.0" "pydantic==2.13.4" "py-cpuinfo" "msgpack" "ninja" "einops" "nvidia-ml-py")

# What the box's image already holds (.library/device/KINDS.md, read 2026-11-17): its own
# builds are used, not shadowed by ours.
BOX_HAS="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt
jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx
onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning
pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn
sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy
tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers
toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray
xxhash yarl zipp"

normalize() { echo "$1" | tr 'A-Z_.' 'a-z--'; }
inputs="v2|$PYTHON_VERSION|$PLATFORMS|${REQUIREMENTS[*]}|$DEEPSPEED|${DEEPSPEED_DEPS[*]}"

# 1. The whole closure, once per input set (a stamp file says what the cache holds).
if [ "$(cat "$CACHE/.inputs" 2>/dev/null)" != "$inputs" ]; then
  rm -rf "$CACHE" && mkdir -p "$CACHE"
  "$PYTHON" -m pip wheel -q -w "$CACHE" "${REQUIREMENTS[@]}" "${DEEPSPEED_DEPS[@]}"
  DS_BUILD_OPS=0 "$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$CACHE" "$DEEPSPEED"
  # No torch, nor the CUDA libraries a torch would pull (nvidia_ml_py, NVML's bindings, stays).
  find "$CACHE" -name 'torch-[0-9]*.whl' -o -name 'triton-[0-9]*.whl' -o -name 'cuda_*.whl' \
    -o -name 'nvidia_*.whl' ! -name 'nvidia_ml_py-*' | xargs -r rm -f
  # 2. Compiled wheels are per Python version and platform: swap each for the target's build.
  if [ "$PYTHON_VERSION" != "$HERE_VERSION" ] || [ -n "${FORCE_SWAP:-}" ]; then
    plat_args=(); for p in $PLATFORMS; do plat_args+=(--platform "$p"); done
    for whl in "$CACHE"/*.whl; do
      base=$(basename "$whl"); tags=${base%.whl}
      pytag=$(echo "$tags" | rev | cut -d- -f3 | rev)
      # Pure Python for every version (py3 / py2.py3, abi none, platform any) fits as it is;
      # a per-version pure wheel (multiprocess: py311-none-any) is swapped like a compiled one.
      [[ "$tags" == *-none-any ]] && [[ "$pytag" == py3 || "$pytag" == py2.py3 ]] && continue
      name=${base%%-*}; version=$(echo "$base" | cut -d- -f2)
      rm -f "$whl"
      "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" \
        --implementation cp "${plat_args[@]}" -d "$CACHE" "$name==$version"
    done
  fi
  echo "$inputs" > "$CACHE/.inputs"
fi

# 3. DEST = the closure, less what the box has (unless KEEP_BOX=1).
if [ "$DEST" = ".whl" ]; then
  exclude=$(git rev-parse --git-path info/exclude 2>/dev/null || echo .git/info/exclude)  # a worktree's .git is a file
  grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
fi
rm -rf "$DEST" && mkdir -p "$DEST" && touch "$DEST/$DEST_STAMP"
for whl in "$CACHE"/*.whl; do
  name=$(normalize "$(basename "$whl" | cut -d- -f1)")
  if [ "$KEEP_BOX" != 1 ] && [[ " $(echo $BOX_HAS) " == *" $name "* ]]; then
    continue
  fi
  cp "$whl" "$DEST/"
done
echo "gpu_wheels: $(ls "$DEST"/*.whl | wc -l) wheels, $(du -sh "$DEST" | cut -f1), python $PYTHON_VERSION -> $DEST"
