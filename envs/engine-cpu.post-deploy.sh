#!/usr/bin/env bash
# Snakemake runs this inside the new conda environment, from the repository root.
set -euo pipefail
# The PyPI builds of these do not load beside torch's +cpu build.
python -m pip uninstall --yes torchvision torchaudio torchcodec || true
python -m pip install --no-deps --editable .
