"""No number in a note's prose is typed by hand (DESIGN.md, principle 3).

Scans every ``paper/**/*.tex`` for numerals outside the contexts where a numeral is not
a result, and fails naming ``file:line`` for each. Allowed:

* comments;
* identifiers in ``\\texttt{...}`` that contain a letter (``note2.ipynb``, ``note2-cpu``),
  the notebook named by ``\\kvmadeby`` and the file, notebook and label of ``\\kvfigure``;
* arguments of cross-references and file references: ``\\ref``, ``\\eqref``,
  ``\\label``, ``\\cite*``, ``\\input``, ``\\include``, ``\\includegraphics`` (with its
  options), ``\\bibliography*``, ``\\url``, ``\\path``, ``\\href``, ``\\graphicspath``;
* set-up: ``\\documentclass`` and ``\\usepackage`` options, ``\\sisetup``,
  ``\\setlength``, ``\\newcommand``'s argument count and ``#1``-style parameters,
  tabular column specs;
* TeX lengths (``0.8\\linewidth``, ``0.4em``, ``11pt``...);
* inside math, the structural constants 0, 1 and 2 (``1 - 1/n``, ``T(T-1)/2``);
* percentile metric names ``p50``, ``p90``, ``p95``, ``p99``.

Published values live in ``paper/reported/*.csv`` (not scanned) and every result comes
from generated ``numbers/``, ``tables/`` and ``figures/`` files.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

PAPER = Path(__file__).resolve().parents[1] / "paper"

# commands whose (optional and) mandatory arguments are not prose
ARG_COMMANDS = (
    "ref", "eqref", "autoref", "label", "cite", "citep", "citet", "citealp", "input", "include",
    "includegraphics", "bibliography", "bibliographystyle", "url", "path", "href", "graphicspath",
    "documentclass", "usepackage", "sisetup", "setlength", "addtolength", "kvfigure", "kvmadeby",
)
# identifiers set in typewriter (file, notebook and experiment names): allowed when they
# contain a letter, so a bare number cannot hide in them
IDENTIFIER = re.compile(r"\\texttt\{([^{}]*[A-Za-z][^{}]*)\}")
LENGTH = re.compile(r"[-+]?\d*\.?\d+\s*(?:pt|em|ex|in|cm|mm|bp|sp|\\(?:line|text|column|paper)width|\\textheight)\b")
METRIC = re.compile(r"\bp(?:50|90|95|99)\b")
PARAM = re.compile(r"#\d")
NUMERAL = re.compile(r"\d")


def _blank(text: str, start: int, end: int) -> str:
    """Replace text[start:end] with spaces, keeping newlines (so line numbers stay)."""
    return text[:start] + "".join("\n" if c == "\n" else " " for c in text[start:end]) + text[end:]


def _group_end(text: str, i: int, open_: str, close: str) -> int:
    """Index after the group opening at text[i] (balanced, escapes skipped)."""
    depth = 0
    j = i
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == open_:
            depth += 1
        elif c == close:
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return len(text)


def strip_allowed(text: str) -> str:
    """The text with every allowed numeral context blanked out."""
    # comments: an unescaped % to the end of the line
    text = re.sub(r"(?<!\\)%[^\n]*", lambda m: " " * len(m.group(0)), text)
    # arguments of non-prose commands (kvfigure: only its file argument)
    pat = re.compile(r"\\(" + "|".join(ARG_COMMANDS) + r")\*?(?![A-Za-z])")
    pos = 0
    while (m := pat.search(text, pos)) is not None:
        j = m.end()
        nargs = 3 if m.group(1) == "kvfigure" else 2 if m.group(1) in ("setlength", "addtolength", "href") else 1
        while j < len(text) and text[j] in " \t":
            j += 1
        if j < len(text) and text[j] == "[":
            end = _group_end(text, j, "[", "]")
            text = _blank(text, j, end)
            j = end
        for _ in range(nargs):
            while j < len(text) and text[j] in " \t\n":
                j += 1
            if j < len(text) and text[j] == "{":
                end = _group_end(text, j, "{", "}")
                text = _blank(text, j, end)
                j = end
        pos = j
    text = IDENTIFIER.sub(lambda m: " " * len(m.group(0)), text)
    # \newcommand{\name}[n]
    text = re.sub(r"(\\(?:re)?newcommand\*?\{\\[A-Za-z]+\})\[\d\]", lambda m: m.group(1) + " " * 3, text)
    # tabular column specs
    for m in re.finditer(r"\\begin\{tabular\*?\}", text):
        j = m.end()
        if j < len(text) and text[j] == "{":
            text = _blank(text, j, _group_end(text, j, "{", "}"))
    text = PARAM.sub(lambda m: "  ", text)
    text = LENGTH.sub(lambda m: " " * len(m.group(0)), text)
    text = METRIC.sub(lambda m: " " * len(m.group(0)), text)
    # math: allow standalone 0, 1, 2
    def math(m: re.Match) -> str:
        return re.sub(r"(?<![\d.])[012](?![\d.])", " ", m.group(0))
    text = re.sub(r"\\\[.*?\\\]", math, text, flags=re.S)
    text = re.sub(r"\\begin\{(equation|align|gather)\*?\}.*?\\end\{\1\*?\}", math, text, flags=re.S)
    text = re.sub(r"(?<!\\)\$.*?(?<!\\)\$", math, text, flags=re.S)
    return text


def numerals_in(raw: str, name: str) -> list[str]:
    """``name:line: text`` for every numeral of ``raw`` outside the allowed contexts."""
    cleaned = strip_allowed(raw)
    lines = raw.splitlines()
    return [f"{name}:{i}: {lines[i - 1].strip()}"
            for i, line in enumerate(cleaned.splitlines(), 1) if NUMERAL.search(line)]


def numerals(path: Path) -> list[str]:
    return numerals_in(path.read_text(), str(path.relative_to(PAPER.parent)))


def tex_files() -> list[Path]:
    return sorted(PAPER.rglob("*.tex"))


def test_there_are_notes():
    notes = {p.parent.name for p in PAPER.glob("*/main.tex")}
    assert {"kv-reuse", "note2", "tn4", "sticky"} <= notes


@pytest.mark.parametrize("path", tex_files(), ids=lambda p: str(p.relative_to(PAPER)))
def test_no_numeral_typed_by_hand(path):
    found = numerals(path)
    assert not found, "numerals typed by hand (generate them into numbers/*.tex):\n" + "\n".join(found)


@pytest.mark.parametrize("snippet, bad", [
    (r"KV-aware was 24 percent faster.", True),
    (r"KV-aware was \kvNoteTwoSimChangeTtcSix{} faster (Table~\ref{tab:2}).", False),
    (r"\includegraphics[width=0.8\linewidth]{figures/note2/x.pdf}", False),
    (r"% a comment with 42", False),
    (r"$q = 1 - 1/n$ and $T(T-1)/2$", False),
    (r"$41\times$ the work", True),
    (r"the p99 TTFT", False),
    (r"\setlength{\parskip}{0.4em}", False),
    (r"\cite{kwon2023pagedattention}", False),
    (r"\begin{tabular}{p{0.3\linewidth}l}", False),
    (r"\section{Results for 2026}", True),
    (r"made by \texttt{notebooks/note2.ipynb}", False),
    (r"\texttt{42}", True),
])
def test_scanner(snippet, bad):
    assert bool(numerals_in(snippet + "\n", "probe.tex")) is bad
