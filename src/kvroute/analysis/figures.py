"""Figure style and saving: one look for every note, PDF for LaTeX and PNG for the README.

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
    pretty = {"round_robin": "round-robin", "least_loaded": "least-loaded", "kv_aware": "KV-aware",
              "cost_aware": "cost-aware", "hybrid_sticky": "hybrid sticky", "prefix_approx": "prefix (SGLang)",
              "random": "random", "sticky": "sticky", "dynamo": "Dynamo", "loadaware": "load-aware"}.get(name, name)
    if not params:
        return pretty
    parts = []
    for kv in params.split(","):
        k, _, v = kv.partition("=")
        k = {"alpha": "α", "threshold_ms": "threshold"}.get(k.strip(), k.strip())
        v = f"{v} ms" if k == "threshold" else v
        parts.append(f"{k}={v}" if k != "threshold" else f"{v}")
    return f"{pretty} {' '.join(parts)}"
