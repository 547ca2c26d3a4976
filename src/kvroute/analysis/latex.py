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
import shutil
import subprocess
import tempfile
from pathlib import Path

from kvroute.records import write_atomic

NOTES = ("kv-reuse", "note2", "tn4", "sticky")


def tex_env(paper_dir: Path, results_dir: Path, base: dict | None = None) -> dict:
    """The environment latexmk needs: TEXINPUTS and BIBINPUTS pointing at results/ and paper/common/."""
    env = dict(os.environ if base is None else base)
    common, results = (Path(paper_dir) / "common").resolve(), Path(results_dir).resolve()
    env["TEXINPUTS"] = f".:{results}:{common}:" + env.get("TEXINPUTS", "")
    env["BIBINPUTS"] = f".:{common}:" + env.get("BIBINPUTS", "")
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
