"""Compiling a note: latexmk in a scratch copy, with the generated files on TEXINPUTS.

A note's main.tex says ``\\input{preamble.tex}`` and ``\\bibliography{refs}``
(found through ``paper/common/`` on TEXINPUTS/BIBINPUTS) and
``\\input{numbers/<note>.tex}``, ``\\input{tables/<note>/x.tex}``,
``\\includegraphics{figures/<note>/x.pdf}`` and ``manifest.tex`` (or, failing that,
``tables/provenance.tex``) for the provenance appendix (found through ``results/``). So a note compiles anywhere with::

    TEXINPUTS=.:<results>:<repo>/paper/common: BIBINPUTS=.:<repo>/paper/common: latexmk -pdf main.tex

(the trailing ``:`` keeps TeX's own search path). :func:`compile_note` does exactly
that in a temporary copy and moves the PDF into place atomically.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from kvroute.records import write_atomic

NOTES = ("kv-reuse", "note2", "tn4", "sticky", "field")
#: the largest overfull box a note may have (a reviewer sees text run into the margin past it)
MAX_OVERFULL_PT = 1.0
_OVERFULL = re.compile(r"^Overfull \\([hv])box \(([0-9.]+)pt too (?:wide|high)\)(.*)$", re.M)


def overfull_boxes(log_text: str, max_pt: float = MAX_OVERFULL_PT) -> list[str]:
    """The Overfull boxes of a LaTeX log wider (or taller) than ``max_pt``, one line each."""
    return [m[0] for m in _OVERFULL.finditer(log_text) if float(m[2]) > max_pt]


def check_log(path: Path, max_pt: float = MAX_OVERFULL_PT) -> int:
    """Exit status for a note's ``main.log``: 1, naming each box, when one overflows by more than ``max_pt``."""
    bad = overfull_boxes(Path(path).read_text(errors="replace"), max_pt)
    for line in bad:
        print(f"{path}: {line}", file=sys.stderr)
    if bad:
        print(f"{path}: {len(bad)} overfull box(es) over {max_pt} pt", file=sys.stderr)
    return 1 if bad else 0


def tex_env(paper_dir: Path, results_dir: Path, base: dict | None = None) -> dict:
    """The environment latexmk needs: TEXINPUTS and BIBINPUTS pointing at results/ and paper/common/."""
    env = dict(os.environ if base is None else base)
    common, results = (Path(paper_dir) / "common").resolve(), Path(results_dir).resolve()
    env["TEXINPUTS"] = f".:{results}:{common}:" + env.get("TEXINPUTS", "")
    env["BIBINPUTS"] = f".:{common}:" + env.get("BIBINPUTS", "")
    # TeX wraps its log at 79 characters and latexmk joins a line of exactly that length
    # with the next, so a "No file main.bbl." after one (a long results path) went unseen
    # and bibtex never ran: an unwrapped log keeps latexmk's parse whatever the paths
    env["max_print_line"] = "10000"
    return env


def compile_note(note: str, paper_dir: Path, results_dir: Path, out_pdf: Path, log: Path | None = None) -> Path:
    """Compile ``paper/<note>/main.tex`` in a scratch copy; write ``out_pdf`` atomically.

    Raises:
        FileNotFoundError: latexmk is not installed.
        subprocess.CalledProcessError: LaTeX failed (the log is kept at ``log`` if given).
    """
    if shutil.which("latexmk") is None:
        raise FileNotFoundError("latexmk is not installed (Debian: apt-get install latexmk texlive-latex-recommended texlive-science)")
    src = Path(paper_dir) / note
    with tempfile.TemporaryDirectory(prefix=f"kvroute-{note}-") as tmp:
        work = Path(tmp) / note
        shutil.copytree(src, work)
        cmd = ["latexmk", "-pdf", "-interaction=nonstopmode", "-halt-on-error", "-file-line-error", "main.tex"]
        proc = subprocess.run(cmd, cwd=work, env=tex_env(paper_dir, results_dir), capture_output=True, text=True)
        if log is not None:
            Path(log).parent.mkdir(parents=True, exist_ok=True)
            Path(log).write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, cmd, proc.stdout, proc.stderr)
        write_atomic(Path(out_pdf), lambda t: shutil.copyfile(work / "main.pdf", t))
    return Path(out_pdf)


if __name__ == "__main__":  # python -m kvroute.analysis.latex main.log: the note rule's check
    sys.exit(check_log(Path(sys.argv[1])) if len(sys.argv) == 2 else 2)
