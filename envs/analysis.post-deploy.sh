#!/usr/bin/env bash
# Snakemake runs this inside the new conda environment, from the repository root.
set -euo pipefail
python -m pip install --no-deps --editable .
