"""YAML reading through libyaml's C parser when PyYAML has it (the pure-Python one is ~10x slower).

Every config, experiment and hardware file goes through here; the workflow reads a few
dozen of them on each Snakemake start, where the parser's speed is most of the cost.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_yaml(text: str) -> Any:
    """Parse YAML text safely (plain data only); raises ``yaml.YAMLError`` on bad input."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a safe loader


def read_yaml(path: str | Path) -> Any:
    """:func:`load_yaml` of a file's text."""
    return load_yaml(Path(path).read_text())
