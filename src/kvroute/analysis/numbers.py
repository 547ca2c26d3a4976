"""Number macros for prose: ``numbers/<note>.tex`` with one ``\\newcommand`` per number.

A note never types a number: it ``\\input``s this file and writes ``\\kvNoteTwoRRTtcSix``.
Names are letters only (TeX control words), start with ``kv`` and are unique in a file;
a repeated or malformed name raises at once, naming it. Flags become ``\\newif``
switches (``\\ifkvStickyMeasured ... \\else ... \\fi``) so prose can say "missing"
without a numeral.

    nums = Numbers()
    nums.add("kvNoteTwoRRTtcSix", 29.21, digits=1, unit=r"\\second")
    nums.add("kvNoteTwoRRHit", 0.652, percent=True, digits=0)
    nums.flag("kvNoteTwoMeasured", False)
    nums.write(out_dir / "numbers" / "note2.tex")
"""

from __future__ import annotations

import re
from pathlib import Path

from kvroute.analysis.stats import Interval
from kvroute.analysis.tables import DASH, Tex, escape, num, num_ci, write_text

_NAME = re.compile(r"^kv[A-Z][A-Za-z]*$")


class Numbers:
    """An ordered set of macros, written together to one file."""

    def __init__(self, source: str = "") -> None:
        self.source = source  # named in the file's header (the notebook)
        self._defs: dict[str, str] = {}
        self._flags: dict[str, bool] = {}

    def _check(self, name: str) -> None:
        if not _NAME.match(name):
            raise ValueError(f"number name {name!r}: letters only, starting with 'kv' and a capital")
        if name in self._defs or name in self._flags:
            raise ValueError(f"number name {name!r} defined twice")

    def tex(self, name: str, latex: str) -> str:
        """Define ``\\name`` as raw LaTeX."""
        self._check(name)
        self._defs[name] = latex.latex if isinstance(latex, Tex) else str(latex)
        return self._defs[name]

    def add(self, name: str, value: object, digits: int = 1, unit: str | None = None, percent: bool = False) -> str:
        """Define ``\\name`` as a number (siunitx; NaN becomes a dash)."""
        return self.tex(name, num(value, digits, unit, percent))

    def add_int(self, name: str, value: int) -> str:
        """Define ``\\name`` as an integer count."""
        return self.tex(name, num(int(value), 0))

    def add_ci(self, name: str, iv: Interval, digits: int = 1, unit: str | None = None, percent: bool = False) -> str:
        """Define ``\\name`` as mean +- half-width (the mean alone for one round)."""
        return self.tex(name, num_ci(iv, digits, unit, percent))

    def text(self, name: str, text: str) -> str:
        """Define ``\\name`` as plain text (escaped)."""
        return self.tex(name, Tex(escape(text)))

    def dash(self, name: str) -> str:
        return self.tex(name, DASH)

    def flag(self, name: str, value: bool) -> None:
        """A ``\\newif\\if<name>`` switch set to ``value``."""
        self._check(name)
        self._flags[name] = bool(value)

    def __contains__(self, name: str) -> bool:
        return name in self._defs or name in self._flags

    def __getitem__(self, name: str) -> str:
        return self._defs[name]

    def render(self) -> str:
        head = f"% generated{' by ' + self.source if self.source else ''}; do not edit\n"
        lines = [head]
        for name, value in self._flags.items():
            lines.append(rf"\newif\if{name}\{name}{'true' if value else 'false'}")
        for name, latex in self._defs.items():
            lines.append(rf"\newcommand{{\{name}}}{{{latex}}}")
        return "\n".join(lines) + "\n"

    def write(self, path: Path) -> None:
        """Write every macro to ``path`` atomically."""
        write_text(Path(path), self.render())


__all__ = ["Numbers", "Tex"]
