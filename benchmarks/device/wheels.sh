#!/usr/bin/env bash
# Download into .whl/ (git-ignored through .git/info/exclude) the wheels that
# benchmarks/device/gpu_session.sh installs on the lent GPU machine, whose image has Python 3.12
# and older or missing packages and no network. The versions are uv.lock's. Packages the image
# already has at versions that satisfy these (torch, numpy, pyarrow, pandas, huggingface-hub,
# tokenizers, safetensors, accelerate, tqdm, tensorboard, matplotlib) are not carried.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
for spec in transformers==5.23.0 datasets==5.2.0 peft==0.21.2 liger-kernel==0.8.5 \
    torchdata==0.11.0 pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 \
    typing-inspection==0.4.5 typing-extensions==4.16.0 python-dotenv==1.2.4 tomli-w==1.2.0 \
    dill==0.4.1 multiprocess==0.70.19; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d .whl "$spec"
done
ls .whl
