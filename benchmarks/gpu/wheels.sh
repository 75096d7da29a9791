#!/usr/bin/env bash
# Downloads, where pip reaches PyPI, the wheels the GPU machines lack (no registry is reachable
# from them), for their Python: CPython 3.12 on manylinux x86_64. run.sh installs them there.
#
#   bash benchmarks/gpu/wheels.sh [DIR]        # default .whl/ of this checkout (git-ignored)
#
# The GPU image has torch 2.11.0+cu130, Triton 3.6.0, transformers 5.17.0, numpy, rich,
# matplotlib, tensorstore, safetensors, pytest (+ xdist, timeout); the list below is what
# d9d and the stages need beyond it, one pinned version each:
# - d9d's own dependencies the image lacks: optree, google-crc32c;
# - liger-kernel, a baseline of the kernels stage (0.8.5: the version measured on an H100
#   on 2026-11-22, benchmarks/results/kernels-nvidia-h100-80gb-hbm3.json);
# - torchtitan, a baseline of the mfu stage, and what `import torchtitan.models.llama3`
#   imports that the image lacks: spmd_types (pinned by torchtitan), tyro and its
#   docstring-parser and typeguard. torchtitan's other requirements (torchdata, datasets,
#   tensorboard, wandb, einops, torch_checkpointing) serve its trainer, not the model the
#   benchmark builds, and are left out to keep the folder small.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
dir="${1:-$repo/.whl}"
wheels=(
    optree==0.20.0
    google-crc32c==1.9.0
    liger-kernel==0.8.5
    torchtitan==0.3.0
    spmd_types==0.2.3
    tyro==1.0.17
    docstring-parser==0.18.0
    typeguard==4.6.1
)
rm -rf "$dir"
mkdir -p "$dir"
python3 -m pip download -q --no-deps --only-binary=:all: --disable-pip-version-check \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any \
    -d "$dir" "${wheels[@]}"
ls -l "$dir"
echo "$(find "$dir" -type f -name '*.whl' | wc -l) wheels, $(du -sh "$dir" | cut -f1) in $dir"
