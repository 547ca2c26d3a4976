"""Workloads: the trace model, synthetic generators, ShareGPT and Mooncake conversion and download.

See docs/workloads.md for the generators' parameters and the sources of their fits. The
field's generator is ``generate("field", ...)`` or ``kvroute.workload.field.field`` (the
package attribute ``field`` is that submodule).
Names are imported lazily (PEP 562), so ``from kvroute.workload.trace import Trace``
costs no pandas, pyarrow or tqdm import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, tuple[str, ...]] = {
    "distributions": ("Dist", "parse_dist"),
    "field": ("FIELD_DEFAULTS",),
    "field_presets": ("LLMD_LADDER", "PRESETS", "Preset"),
    "generators": (
        "GENERATORS", "TOKENS_PER_WORD", "agent", "generate", "generator_params", "note2",
        "sharegpt_fit", "sharegpt_like", "words_to_tokens",
    ),
    "datasets": ("DATASETS", "check_dataset_params", "dataset_params", "load_dataset"),
    "io": ("read_trace", "trace_from_frame", "trace_to_frame", "write_trace"),
    "mooncake": ("MOONCAKE_TRACES", "fetch_mooncake", "mooncake_trace"),
    "sharegpt": (
        "SHAREGPT_FILENAME", "SHAREGPT_SHA256", "SHAREGPT_SIZE", "SHAREGPT_URL",
        "ChecksumMismatch", "DownloadError", "convert_sharegpt", "describe_tokenizer",
        "download", "download_sharegpt", "iter_records",
    ),
    "trace": ("Conversation", "Mode", "Trace", "Turn"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # for type checkers and IDEs; at run time names load on first use
    from kvroute.workload.distributions import Dist, parse_dist  # noqa: F401
    from kvroute.workload.field import FIELD_DEFAULTS  # noqa: F401
    from kvroute.workload.field_presets import LLMD_LADDER, PRESETS, Preset  # noqa: F401
    from kvroute.workload.generators import (  # noqa: F401
        GENERATORS, TOKENS_PER_WORD, agent, generate, generator_params, note2, sharegpt_fit,
        sharegpt_like, words_to_tokens,
    )
    from kvroute.workload.datasets import (  # noqa: F401
        DATASETS, check_dataset_params, dataset_params, load_dataset,
    )
    from kvroute.workload.io import (  # noqa: F401
        read_trace, trace_from_frame, trace_to_frame, write_trace,
    )
    from kvroute.workload.mooncake import (  # noqa: F401
        MOONCAKE_TRACES, fetch_mooncake, mooncake_trace,
    )
    from kvroute.workload.sharegpt import (  # noqa: F401
        SHAREGPT_FILENAME, SHAREGPT_SHA256, SHAREGPT_SIZE, SHAREGPT_URL, ChecksumMismatch,
        DownloadError, convert_sharegpt, describe_tokenizer, download, download_sharegpt,
        iter_records,
    )
    from kvroute.workload.trace import Conversation, Mode, Trace, Turn  # noqa: F401
