"""Workloads: the trace model, synthetic generators, ShareGPT conversion and download.

See docs/workloads.md for the generators' parameters and the sources of their fits.
Names are imported lazily (PEP 562): ``from kvroute.workload.trace import Trace``
costs no pandas, pyarrow or tqdm import.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    **dict.fromkeys(
        ["GENERATORS", "TOKENS_PER_WORD", "agent", "generate", "generator_params", "note2",
         "sharegpt_fit", "sharegpt_like", "words_to_tokens"],
        "generators",
    ),
    **dict.fromkeys(["read_trace", "trace_from_frame", "trace_to_frame", "write_trace"], "io"),
    **dict.fromkeys(
        ["SHAREGPT_FILENAME", "SHAREGPT_SHA256", "SHAREGPT_SIZE", "SHAREGPT_URL", "ChecksumMismatch",
         "DownloadError", "convert_sharegpt", "describe_tokenizer", "download", "download_sharegpt",
         "iter_records"],
        "sharegpt",
    ),
    **dict.fromkeys(["Conversation", "Mode", "Trace", "Turn"], "trace"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


