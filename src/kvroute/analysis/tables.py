"""LaTeX tables: booktabs rules, siunitx numbers, escaped text, atomic writes.

A table file holds one bare ``tabular`` (the note wraps it in a ``table`` float and
writes the caption in prose), so the same file serves any layout. Cells are:

* :class:`Tex` - already LaTeX, written as is (built by :func:`num`, :func:`num_ci`...);
* ``str`` - plain text, LaTeX-escaped (``cost_aware:alpha=0.25`` stays literal);
* a number - formatted with :func:`num` (NaN and None become a dash).

The preamble (paper/common/preamble.tex) must load booktabs and siunitx and set
``uncertainty-mode = separate`` so ``\\num{113.6 \\pm 1.2}`` prints "113.6 ± 1.2".
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from kvroute.analysis.stats import Interval
from kvroute.records import write_atomic


class Tex:
    """LaTeX that is written as is (not escaped again).

    Deliberately not a ``str`` subclass: pandas turns ``str`` subclasses into plain
    strings in its string columns, which would lose the mark and escape the LaTeX.
    """

    __slots__ = ("latex",)

    def __init__(self, latex: object = "") -> None:
        self.latex = latex.latex if isinstance(latex, Tex) else str(latex)

    def __str__(self) -> str:
        return self.latex

    def __repr__(self) -> str:
        return f"Tex({self.latex!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Tex) and other.latex == self.latex

    def __hash__(self) -> int:
        return hash(("Tex", self.latex))

    def __add__(self, other: object) -> Tex:
        return Tex(self.latex + (other.latex if isinstance(other, Tex) else escape(other)))

    @staticmethod
    def join(sep: str, items) -> Tex:
        """Join cells (Tex as is, plain text escaped) with the LaTeX separator ``sep``."""
        return Tex(sep.join(escape(i) for i in items))


#: what a table shows where a value is not given or not measured
DASH = Tex(r"\textemdash")

_ESCAPES = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
    "<": r"\textless{}",
    ">": r"\textgreater{}",
    "|": r"\textbar{}",
}
_ESCAPE_RE = re.compile("|".join(re.escape(k) for k in _ESCAPES))


def escape(text: object) -> str:
    """Escape LaTeX's special characters in plain text; :class:`Tex` passes unchanged."""
    if isinstance(text, Tex):
        return text.latex
    return _ESCAPE_RE.sub(lambda m: _ESCAPES[m.group(0)], str(text))


def _missing(value: object) -> bool:
    if value is None:
        return True
    try:
        return isinstance(value, numbers.Real) and math.isnan(value)
    except TypeError:
        return False


def fmt(value: float, digits: int) -> str:
    """Fixed-point text of ``value`` with ``digits`` decimals (no exponent, no -0)."""
    text = f"{value:.{digits}f}"
    return text[1:] if re.fullmatch(r"-0\.?0*", text) else text


def num(value: object, digits: int = 1, unit: str | None = None, percent: bool = False) -> Tex:
    """A number as siunitx LaTeX: ``\\num{v}`` or ``\\qty{v}{unit}``; NaN -> dash.

    Args:
        value: the number (a fraction when ``percent``).
        digits: decimals shown.
        unit: siunitx unit macros, e.g. ``\\milli\\second``.
        percent: multiply by 100 and print with ``\\percent``.
    """
    if _missing(value):
        return DASH
    v = float(value) * (100 if percent else 1)
    unit = r"\percent" if percent else unit
    text = fmt(v, digits)
    return Tex(rf"\qty{{{text}}}{{{unit}}}" if unit else rf"\num{{{text}}}")


def num_ci(iv: Interval, digits: int = 1, unit: str | None = None, percent: bool = False) -> Tex:
    """Mean with its interval half-width, ``\\num{m \\pm h}``; one round: the mean alone."""
    if iv.n == 0 or _missing(iv.mean):
        return DASH
    if not iv.has_interval:
        return num(iv.mean, digits, unit, percent)
    k = 100 if percent else 1
    unit = r"\percent" if percent else unit
    body = rf"{fmt(iv.mean * k, digits)} \pm {fmt(iv.half * k, digits)}"
    return Tex(rf"\qty{{{body}}}{{{unit}}}" if unit else rf"\num{{{body}}}")


def cell(value: object, digits: int = 1) -> str:
    """LaTeX for one cell (see the module docstring)."""
    if isinstance(value, Tex):
        return value.latex
    if isinstance(value, Interval):
        return num_ci(value, digits).latex
    if _missing(value):
        return DASH.latex
    if isinstance(value, bool | np.bool_):
        return "yes" if value else "no"
    if isinstance(value, numbers.Integral):
        return rf"\num{{{int(value)}}}"
    if isinstance(value, numbers.Real):
        return num(value, digits).latex
    return escape(value)


def tabular(
    df: pd.DataFrame,
    align: str | None = None,
    digits: int | dict[str, int] = 1,
    header: Sequence[str] | None = None,
    groups: Sequence[int] = (),
) -> str:
    """A booktabs ``tabular`` of ``df``.

    Args:
        df: rows and columns as shown; cells per :func:`cell`.
        align: column spec (default: ``l`` then ``r`` for the rest).
        digits: decimals for float cells, one number or per column.
        header: column headings (LaTeX as given when :class:`Tex`, else escaped);
            default the column names, escaped.
        groups: row indices before which a ``\\midrule`` separates groups.
    """
    ncol = len(df.columns)
    align = align or ("l" + "r" * (ncol - 1))
    heads = [escape(h) for h in (header if header is not None else [str(c) for c in df.columns])]
    if len(heads) != ncol:
        raise ValueError(f"header has {len(heads)} entries for {ncol} columns")
    lines = [rf"\begin{{tabular}}{{{align}}}", r"\toprule", " & ".join(heads) + r" \\", r"\midrule"]
    for i, row in enumerate(df.itertuples(index=False)):
        if i in groups and i > 0:
            lines.append(r"\midrule")
        cells = []
        for col, v in zip(df.columns, row):
            d = digits.get(col, 1) if isinstance(digits, dict) else digits
            cells.append(cell(v, d))
        lines.append(" & ".join(cells) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}", ""]
    return "\n".join(lines)


def write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (a temp file, then rename)."""
    write_atomic(Path(path), lambda tmp: Path(tmp).write_text(text))


def write_table(path: Path, df: pd.DataFrame, **kwargs) -> None:
    """Write :func:`tabular` of ``df`` to ``path`` atomically; kwargs as :func:`tabular`."""
    write_text(path, "% generated by kvroute.analysis.tables; do not edit\n" + tabular(df, **kwargs))


#: readable policy names, for tables and figure legends alike
POLICY_NAMES = {
    "round_robin": "round-robin", "least_loaded": "least-loaded", "kv_aware": "KV-aware",
    "cost_aware": "cost-aware", "hybrid_sticky": "hybrid sticky", "prefix_approx": "prefix (SGLang rule)",
    "random": "random", "sticky": "sticky", "dynamo": "Dynamo rule", "loadaware": "load-aware",
    "vllm_cache_aware": "cache-aware (vllm-router rule)", "sglang_cache_aware": "cache-aware (sglang-router rule)", "consistent_hash": "consistent hash", "weighted": "weighted scorers",
    "llmd_precise": "llm-d precise", "llmd_approx": "llm-d approximate", "llmd_load": "llm-d load",
    "blis_queue_depth": "BLIS queue-depth", "blis_prefix_queue": "BLIS prefix:queue 3:2",
    "blis_default": "BLIS prefix:queue:kv 3:2:2",
}
_PARAM_TEX = {"alpha": r"$\alpha$", "threshold_ms": "threshold", "beta": r"$\beta$"}
#: production routers run as peers (``sglang_router:cache_aware``): router, then its own policy
_PEER_NAMES = {"sglang_router": "sglang-router", "vllm_router": "vllm-router"}


def _number(value: str) -> str:
    """A spec's numeric value as it is printed everywhere: ``1.0`` and ``1`` alike as ``1``."""
    try:
        return f"{float(value):g}"
    except ValueError:
        return value


def policy_tex(spec: str) -> Tex:
    """A policy spec as readable LaTeX: ``cost_aware:alpha=0.25`` -> ``cost-aware, $\\alpha$ = 0.25``."""
    name, _, params = spec.partition(":")
    if name in _PEER_NAMES:  # ``sglang_router:cache_aware`` -> ``sglang-router, cache_aware``
        return Tex(escape(f"{_PEER_NAMES[name]}, {params}") if params else escape(_PEER_NAMES[name]))
    text = escape(POLICY_NAMES.get(name, name))
    parts = []
    for kv in filter(None, params.split(",")):
        k, _, v = kv.partition("=")
        k = k.strip()
        unit = r"\,ms" if k.endswith("_ms") else ""
        sep = " " if k.endswith("_ms") else " = "
        parts.append(f"{_PARAM_TEX.get(k, escape(k))}{sep}{escape(_number(v.strip()))}{unit}")
    return Tex(text + (", " + ", ".join(parts) if parts else ""))


def stack(*lines: str, align: str = "r") -> Tex:
    """A multi-line header cell: each line is LaTeX, stacked in a nested tabular."""
    body = r" \\ ".join(escape(x) if isinstance(x, Tex) else str(x) for x in lines)
    return Tex(rf"\begin{{tabular}}[b]{{@{{}}{align}@{{}}}}{body}\end{{tabular}}")
