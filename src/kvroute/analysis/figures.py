"""Figure style and saving: one look for every note, PDF for LaTeX and PNG for the README.

:func:`against_load` draws a metric against an experiment's load axis, one line per
policy (:mod:`kvroute.analysis.load_curves`).

Figures are sized for a one-column note (:data:`WIDTH_IN` wide, the text width of
the notes' layout) and drawn with constrained layout so nothing is clipped. Each file
records the notebook that made it: PDF ``Creator``/``Subject`` and PNG ``Source``
metadata, and the note's caption names it too.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import seaborn as sns  # noqa: E402

from kvroute.records import write_atomic  # noqa: E402

#: the notes' text width (article, 1 inch margins on A4/letter) in inches
WIDTH_IN = 6.3
#: default height for a single panel row
HEIGHT_IN = 2.8
#: PNG resolution for the README
PNG_DPI = 200


def setup() -> None:
    """Seaborn's paper style with fonts that stay legible at the notes' size."""
    sns.set_theme(context="paper", style="whitegrid", palette="colorblind", font_scale=1.0)
    plt.rcParams.update({
        "figure.constrained_layout.use": True,
        "font.size": 8.5,
        "axes.titlesize": 9,
        "axes.labelsize": 8.5,
        "legend.fontsize": 7.5,
        "legend.title_fontsize": 8,
        "xtick.labelsize": 7.5,
        "ytick.labelsize": 7.5,
        "pdf.fonttype": 42,
    })


def figure(nrows: int = 1, ncols: int = 1, height: float = HEIGHT_IN, width: float = WIDTH_IN, **kw):
    """A constrained-layout figure at the notes' width."""
    return plt.subplots(nrows, ncols, figsize=(width, height), layout="constrained", **kw)


def save(fig, out_dir: Path, family: str, name: str, notebook: str, title: str = "") -> list[Path]:
    """Write ``figures/<family>/<name>.pdf`` and ``.png`` under ``out_dir`` atomically.

    Args:
        fig: the matplotlib figure.
        out_dir: the notebook's ``out_dir``.
        family: the note's figure folder (``note2``, ``kv-reuse``...).
        name: file stem.
        notebook: the notebook that made it (recorded in the files' metadata).
        title: a one-line description for the metadata.
    """
    base = Path(out_dir) / "figures" / family
    made_by = f"notebooks/{notebook}"
    paths = []
    pdf_meta = {"Creator": made_by, "Subject": f"made by {made_by}", "Title": title or name}
    png_meta = {"Source": made_by, "Title": title or name, "Software": "kvroute"}
    for ext, meta, extra in (("pdf", pdf_meta, {}), ("png", png_meta, {"dpi": PNG_DPI})):
        path = base / f"{name}.{ext}"
        write_atomic(path, lambda tmp, ext=ext, meta=meta, extra=extra: fig.savefig(tmp, format=ext, metadata=meta, **extra))
        paths.append(path)
    plt.close(fig)
    return paths


def label(policy: str) -> str:
    """A readable legend label for a policy spec (``cost_aware:alpha=0.25`` -> ``cost-aware α=0.25``)."""
    name, _, params = policy.partition(":")
    from kvroute.analysis.tables import _PEER_NAMES, POLICY_NAMES

    if name in _PEER_NAMES:  # a production router and its own policy: ``sglang-router cache_aware``
        return f"{_PEER_NAMES[name]} {params}".strip()

    pretty = POLICY_NAMES.get(name, name)
    if not params:
        return pretty
    parts = []
    for kv in params.split(","):
        k, _, v = kv.partition("=")
        k = {"alpha": "α", "threshold_ms": "threshold"}.get(k.strip(), k.strip())
        from kvroute.analysis.tables import _number

        v = _number(v.strip())
        v = f"{v} ms" if k == "threshold" else v
        parts.append(f"{k}={v}" if k != "threshold" else f"{v}")
    return f"{pretty} {' '.join(parts)}"


def against_load(ax, curves, metric: str, scale: float = 1.0, ylabel: str | None = None,
                 policies: list[str] | None = None, palette: dict | None = None, log_x: bool = False) -> None:
    """Draw ``metric`` against load on ``ax``: one line per policy (markers at the means,
    a band over the t-interval where there is one), from a
    :func:`kvroute.analysis.load_curves.load_curves` frame of one experiment and hardware.

    Args:
        metric: a summarised column (``ttft_mean_ms``, ``goodput_rps``...).
        scale: factor for the values (100 for a rate in percent).
        ylabel: the axis label (default :data:`~kvroute.analysis.load_curves.CURVE_METRICS`').
        policies: which policies, in legend order (default every one, as in ``curves``).
        palette: colour per policy (default seaborn's colorblind palette in that order).
        log_x: a logarithmic load axis (for ladders such as 3, 10, 30, 60).
    """
    from kvroute.analysis.load_curves import CURVE_METRICS, GOODPUT_METRICS

    if f"{metric}_mean" not in curves:
        raise ValueError(f"curves have no metric {metric!r}; they have "
                         f"{', '.join(c[:-5] for c in curves.columns if c.endswith('_mean'))}")
    if curves[["experiment", "hardware"]].drop_duplicates().shape[0] > 1:
        raise ValueError("curves hold several experiments or hardware profiles: select one first")
    order = policies or list(dict.fromkeys(curves["policy"]))
    colours = palette or dict(zip(order, sns.color_palette("colorblind", len(order))))
    data = curves[curves["policy"].isin(order)].assign(value=lambda d: scale * d[f"{metric}_mean"])
    sns.lineplot(data=data, x="load", y="value", hue="policy", hue_order=order, palette=colours, marker="o",
                 markersize=4, linewidth=1.2, errorbar=None, ax=ax, legend=False)
    for pol in order:
        d = data[data["policy"] == pol]
        if d[f"{metric}_half"].notna().any():
            lo = scale * d[f"{metric}_lo"]
            if (data["value"].dropna() >= 0).all():  # a non-negative metric: its band stops at zero
                lo = lo.clip(lower=0)
            ax.fill_between(d["load"], lo, scale * d[f"{metric}_hi"], color=colours[pol], alpha=0.2, linewidth=0)
    for pol in order:  # legend entries (seaborn's own lines stay unlabelled): fig.legend(*ax.get_legend_handles_labels())
        ax.plot([], [], marker="o", ms=4, lw=1.2, color=colours[pol], label=label(pol))
    param = curves["load_param"].dropna().unique()
    ax.set_xlabel({"rate_per_s": "arrival rate (conversations/s)", "chats": "chats at once",
                   "concurrency": "concurrency", "speedup": "trace speed-up"}.get(param[0], param[0]) if len(param) else "load")
    ax.set_ylabel(ylabel or {**CURVE_METRICS, **GOODPUT_METRICS}.get(metric, metric))
    if log_x:
        ax.set_xscale("log")
        loads = sorted(data["load"].unique())
        ax.set_xticks(loads, [f"{v:g}" for v in loads])
        ax.minorticks_off()
