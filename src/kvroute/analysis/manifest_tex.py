"""The provenance appendix: ``results/manifest.json`` rendered as LaTeX.

Every note's appendix does ``\\input{manifest.tex}``. The workflow writes
``results/manifest.json`` (see :func:`kvroute.pipeline.build_manifest`) and calls
:func:`write_manifest_tex` to render it, laid out for a reviewer rather than as a key dump:

- *Source*: commit (short, then in full), whether the tree was dirty, when it was built;
- *The host*: CPU model, cores, memory, operating system;
- *Configuration*: ``file | SHA-256`` (shortened; the JSON keeps the full digest), by folder;
- *Results*: one row per result folder, its kind (simulated, measured, emulated) and records;
- *Hardware profiles*: the shape (GPUs, workers, TP, block, KV blocks), the software (model,
  engine, coefficients) and each profile's description, three tables that fit the text width;
- *Packages*: every environment's package versions, three to a row.

A key the renderer does not know, at the top level or inside a known section (a new
profile field, an entry of an unexpected shape), is never dropped: it is listed under
*Other entries* as a dotted key and its value, as the whole manifest once was. Every key
and value is LaTeX-escaped and long ones wrap (every column is a ``p`` column whose
width is a share of ``\\linewidth``), so the appendix fits any note's text width.

Command line (for a workflow rule)::

    python -m kvroute.analysis.manifest_tex results/manifest.json results/manifest.tex
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from datetime import datetime
from pathlib import Path, PurePosixPath

from kvroute.analysis.tables import DASH as _DASH
from kvroute.analysis.tables import escape, write_text

#: digits of the commit printed first (the full hash follows in small type)
SHORT_COMMIT = 10
#: hex digits of each SHA-256 printed (the JSON file holds all 64)
HASH_DIGITS = 16
#: the kinds of result, in the order the results table lists them
KINDS = ("simulated", "measured", "emulated")
#: a record's ``source`` value -> its kind (used when ``sources`` does not list a folder)
SOURCE_KINDS = {"sim": "simulated", "live": "measured", "emulated": "emulated"}
#: host fields and their labels, in order
HOST_LABELS = {"cpu": "CPU model", "cores": "CPU cores", "memory_gb": "Memory", "os": "Operating system"}
#: the hardware-profile tables: (heading, [(field, column title, share of the line, align)])
PROFILE_TABLES = (
    ("shape", [("gpu", "GPU", 0.27, "l"), ("gpus", "GPUs", 0.07, "r"), ("workers", "Workers", 0.09, "r"),
               ("workers_per_gpu", "Workers per GPU", 0.09, "r"), ("tensor_parallel", "Tensor parallel", 0.09, "r"),
               ("block_size", "Block size (tokens)", 0.10, "r"), ("num_blocks", "KV blocks", 0.11, "r")]),
    ("software", [("model", "Model", 0.22, "l"), ("engine", "Engine", 0.18, "l"),
                  ("coefficients", "Step-time coefficients", 0.17, "l"), ("cpu_affinity", "CPU affinity", 0.15, "l"),
                  ("client_worker", "Client on", 0.10, "l")]),
)
#: share of the line of the profile-name column in every hardware table
PROFILE_COLUMN = 0.18
#: package name/version pairs per row of the packages table
PACKAGE_PAIRS = 3
#: shares of the line of a package name and its version (times PACKAGE_PAIRS: at most 1)
PACKAGE_SHARES = (0.2, 0.13)
#: the label of the top-level ``packages`` (the analysis environment the workflow runs in)
MAIN_ENVIRONMENT = "main"
#: what each environment is for (one the renderer does not know is printed by its name alone)
ENVIRONMENT_LABELS = {
    MAIN_ENVIRONMENT: "the environment that wrote this manifest (simulation, analysis)",
    "engine-cpu": "vLLM on the CPU, for the measurements",
    "engine-gpu": "vLLM on GPUs, for the measurements",
    "routers": "the peer routers the gateway is compared with",
}

DASH = _DASH.latex
#: a page break unless this many lines are left (needspace's test, defined here so that
#: the notes' preamble needs no package), before a section or a table that breaks across
#: pages: its heading, opening text, column titles and first rows never sit alone at a
#: page's foot. The short tables (source, host) are single boxes and need none.
ROOM_LINES = 8


def _need_space(lines: int = ROOM_LINES) -> str:
    return rf"\kvManifestNeedSpace{{{lines}\baselineskip}}"


DEFINE_NEED_SPACE = (r"\providecommand{\kvManifestNeedSpace}[1]{\par\penalty-100\begingroup"
                     r"\setlength{\dimen0}{#1}\dimen2=\pagegoal\advance\dimen2 by -\pagetotal"
                     r"\ifdim\dimen0>\dimen2 \ifdim\dimen2>0pt \vfil\fi\break\fi\endgroup}")
Rows = list[tuple[str, str]]


def _flatten(value, prefix: str = "") -> Rows:
    """``(dotted key, text)`` pairs of a nested value: dicts nest with ``.``, lists of
    scalars are joined, lists of objects are indexed ``[i]``."""
    if isinstance(value, dict):
        out: Rows = []
        for k, v in value.items():
            out += _flatten(v, f"{prefix}.{k}" if prefix else str(k))
        return out or [(prefix, "{}")]
    if isinstance(value, list):
        if all(not isinstance(v, dict | list) for v in value):
            return [(prefix, ", ".join(str(v) for v in value))]
        out = []
        for i, v in enumerate(value):
            out += _flatten(v, f"{prefix}[{i}]")
        return out
    return [(prefix, "" if value is None else str(value))]


#: a run of letters and digits this long gets a break point every BREAK_EVERY characters
LONG_RUN = re.compile(r"[0-9A-Za-z]{24,}")
BREAK_EVERY = 16


#: where an identifier (a path, a package, a hash) may break; prose breaks at spaces and hyphens
CODE_BREAKS = ("/", ".", ",", "-", "=", "_")
TEXT_BREAKS = ("/", ",", "=", "_")


def _breakable(text: object, separators: tuple[str, ...] = CODE_BREAKS) -> str:
    """Escaped text with break points after ``separators`` and inside long runs (a SHA-256
    is 64 characters of typewriter type, wider than most columns), so everything wraps."""
    out = escape(text)
    for sep in separators:
        esc = escape(sep)
        out = out.replace(esc, esc + r"\allowbreak{}")
    return LONG_RUN.sub(lambda m: r"\allowbreak{}".join(
        m[0][i : i + BREAK_EVERY] for i in range(0, len(m[0]), BREAK_EVERY)), out)


def _tt(text: object) -> str:
    """An identifier in typewriter type, breakable after its separators."""
    return rf"\texttt{{{_breakable(text)}}}"


def _text(text: object) -> str:
    """Roman text (a description, a model's name): breaks at spaces and hyphens as prose
    does, and after slashes, commas and in long runs, never inside a version's dots."""
    return _breakable(text, TEXT_BREAKS)


def _count(value: object) -> str:
    """An integer through siunitx (digits grouped); anything else escaped as it is."""
    if isinstance(value, int) and not isinstance(value, bool):
        return rf"\num{{{value}}}"
    return DASH if value is None else _breakable(value)


def _column(share: float, align: str = "l") -> str:
    """A ``p`` column ``share`` of the line wide, less its padding, so shares summing to at
    most 1 fit ``\\linewidth`` (with ``@{}`` at the table's ends)."""
    flush = r"\raggedleft" if align == "r" else r"\raggedright"
    return rf">{{{flush}\arraybackslash}}p{{\dimexpr {share}\linewidth-2\tabcolsep\relax}}"


def _longtable(columns: list[tuple[float, str]], header: list[str] | None, body: list[str]) -> list[str]:
    """A booktabs ``longtable``: it breaks across pages, repeating its header, but never
    after its first row or before its last (``\\*``), so no page holds one row alone."""
    spec = "@{}" + "".join(_column(s, a) for s, a in columns) + "@{}"
    rows = [i for i, line in enumerate(body) if line.endswith(r" \\")]
    body = list(body)
    for i in {rows[0], rows[-2]} if len(rows) >= 2 else set():
        body[i] += "*"
    lines = [rf"\begin{{longtable}}{{{spec}}}", r"\toprule"]
    if header is not None:
        lines += [" & ".join(header) + r" \\", r"\midrule"]
    lines += [r"\endhead", r"\bottomrule", r"\endfoot"]
    return lines + body + [r"\end{longtable}"]


def _tabular(columns: list[tuple[float, str]], body: list[str]) -> list[str]:
    """A short booktabs table as one box (it never breaks, and stays with its heading)."""
    spec = "@{}" + "".join(_column(s, a) for s, a in columns) + "@{}"
    return [rf"\noindent\begin{{tabular}}{{{spec}}}", r"\toprule", *body, r"\bottomrule", r"\end{tabular}\par"]


def _span(n: int, text: str) -> str:
    """A group's heading: one cell across all ``n`` columns, wrapping within the line, kept
    on the page of the group's first row (``\\*``)."""
    return rf"\multicolumn{{{n}}}{{@{{}}{_column(1.0)}@{{}}}}{{{text}}} \\*"


# ---------------------------------------------------------------- sections
# Each takes the manifest's entries it is named for and returns its LaTeX lines and the
# (dotted key, value) pairs it did not show, which go to "Other entries".


def _source(entries: dict) -> tuple[list[str], Rows]:
    rows = []
    if "commit" in entries:
        commit = str(entries["commit"])
        if re.fullmatch(r"[0-9a-f]{12,}", commit):
            rows.append(("Commit", rf"\texttt{{{commit[:SHORT_COMMIT]}}} {{\footnotesize (in full {_tt(commit)})}}"))
        elif commit == "unknown":
            rows.append(("Commit", "unknown: not built from a git work tree"))
        else:
            rows.append(("Commit", _tt(commit)))
    if "dirty" in entries:
        dirty = entries["dirty"]
        text = {True: r"dirty: tracked files had uncommitted changes, so the commit alone does not pin the code",
                False: "clean: the commit pins the code",
                None: "unknown (not a git work tree)"}.get(dirty) if isinstance(dirty, bool | None) else None
        rows.append(("Working tree", text or _breakable(dirty)))
    if "created" in entries:
        rows.append(("Built", _when(entries["created"])))
    body = [rf"{label} & {value} \\" for label, value in rows]
    return _tabular([(0.2, "l"), (0.8, "l")], body), []


def _when(value: object) -> str:
    """An ISO time as ``2026-12-01 22:53:06 UTC`` (another offset is printed as such)."""
    try:
        t = datetime.fromisoformat(str(value))
    except ValueError:
        return _breakable(value)
    zone = "" if t.tzinfo is None else (" UTC" if t.utcoffset().total_seconds() == 0 else t.strftime(" UTC%z"))
    return escape(t.strftime("%Y-%m-%d %H:%M:%S") + zone)


def _host(entries: dict) -> tuple[list[str], Rows]:
    host = entries["host"]
    if not isinstance(host, dict):
        return [], _flatten(host, "host")
    body = []
    for key, label in HOST_LABELS.items():
        if key in host:
            value = host[key]
            text = {"memory_gb": f"{escape(value)} GiB", "cores": f"{escape(value)} (logical)"}.get(key, _text(value))
            body.append(rf"{label} & {text} \\")
    rest = [(f"host.{k}", v) for k, v in host.items() if k not in HOST_LABELS]
    return (_tabular([(0.2, "l"), (0.8, "l")], body) if body else []), _rows(rest)


def _rows(pairs: list[tuple[str, object]]) -> Rows:
    out: Rows = []
    for key, value in pairs:
        out += _flatten(value, key)
    return out


def _configuration(entries: dict) -> tuple[list[str], Rows]:
    hashes = entries["config_hash"]
    if not isinstance(hashes, dict):
        return [], _flatten(hashes, "config_hash")
    groups: dict[str, list[tuple[str, object]]] = {}
    for path, digest in hashes.items():
        p = PurePosixPath(str(path))
        groups.setdefault(str(p.parent), []).append((p.name, digest))
    body = []
    for folder, files in groups.items():
        if body:
            body.append(r"\addlinespace")
        indent = r"\quad" if folder != "." else ""
        if indent:
            body.append(_span(2, rf"\emph{{in}} {_tt(folder + '/')}"))
        for name, digest in files:
            text = str(digest)
            shown = (_tt(text[:HASH_DIGITS]) + r"\ldots") if re.fullmatch(r"[0-9a-f]{40,}", text) else _tt(text)
            body.append(rf"{indent}{_tt(name)} & {shown} \\")
    header = ["File", rf"SHA-256 (first {HASH_DIGITS} hex digits)"]
    return _longtable([(0.6, "l"), (0.4, "l")], header, body), []


def _results(entries: dict) -> tuple[list[str], Rows]:
    sources, results = entries.get("sources", {}), entries.get("results", {})
    rest: Rows = []
    if not isinstance(sources, dict) or not all(isinstance(v, list) for v in sources.values()):
        rest += _flatten(sources, "sources")
        sources = {}
    if not isinstance(results, dict):
        rest += _flatten(results, "results")
        results = {}
    kinds: dict[str, list[str]] = {}
    for kind, folders in sources.items():
        for folder in folders:
            kinds.setdefault(str(folder), []).append(str(kind))
    rows: dict[str, tuple[list[str], object]] = {}
    for folder, info in results.items():
        info = info if isinstance(info, dict) else {"value": info}
        recorded = info.get("sources", [])  # the records' own source values: sim | live | emulated
        shown = {"rows"} | ({"sources"} if isinstance(recorded, list) else set())
        own = [SOURCE_KINDS.get(str(s), str(s)) for s in recorded] if "sources" in shown else []
        rows[folder] = (kinds.get(folder) or own, info.get("rows"))
        rest += _rows([(f"results.{folder}.{k}", v) for k, v in info.items() if k not in shown])
    for folder, kind in kinds.items():
        rows.setdefault(folder, (kind, None))
    order = {k: i for i, k in enumerate(KINDS)}

    def rank(item: tuple[str, tuple[list[str], object]]) -> int:
        return min((order.get(k, len(KINDS)) for k in item[1][0]), default=len(KINDS) + 1)

    body = [rf"{_tt(folder)} & {escape(', '.join(kind)) or DASH} & {_count(n)} \\"
            for folder, (kind, n) in sorted(rows.items(), key=rank)]
    if not body:
        return [r"No result folder was found."], rest
    tally = {k: sum(k in kind for kind, _ in rows.values()) for k in dict.fromkeys([*KINDS, *sources])}
    total = sum(n for _, n in rows.values() if isinstance(n, int) and not isinstance(n, bool))
    intro = (rf"{len(rows)} result folder{'s' if len(rows) != 1 else ''} under \texttt{{results/}}: "
             + ", ".join(f"{n} {escape(k)}" for k, n in tally.items())
             + rf"; \num{{{total}}} records in all. Simulated: kvroute's discrete-event simulator; "
             r"measured: requests to real engines; emulated: kvroute's engine emulator in place of real engines.")
    return [intro, "", *_longtable([(0.62, "l"), (0.2, "l"), (0.18, "r")], ["Result", "Kind", "Records"], body)], rest


def _hardware(entries: dict) -> tuple[list[str], Rows]:
    profiles = entries["hardware"]
    if not isinstance(profiles, dict) or not all(isinstance(p, dict) for p in profiles.values()):
        return [], _flatten(profiles, "hardware")
    shown = {"name", "description", "error"} | {f for _, cols in PROFILE_TABLES for f, *_ in cols}
    rest: Rows = []
    for name, p in profiles.items():
        rest += _rows([(f"hardware.{name}.{k}", v) for k, v in p.items()
                       if k not in shown or (k == "name" and str(v) != str(name))])
    lines: list[str] = []
    for _, cols in PROFILE_TABLES:
        header = ["Profile"] + [title for _, title, _, _ in cols]
        body = []
        for name, p in profiles.items():
            cells = [_cell(p, f, a) for f, _, _, a in cols]
            body.append(" & ".join([_tt(name), *cells]) + r" \\")
        widths = [(PROFILE_COLUMN, "l")] + [(s, a) for _, _, s, a in cols]
        lines += [*([_need_space()] if lines else []), r"\begingroup\footnotesize\setlength{\tabcolsep}{4pt}",
                  *_longtable(widths, header, body), r"\endgroup", ""]
    body = []
    for name, p in profiles.items():
        text = _text(p["description"]) if "description" in p else DASH
        if "error" in p:
            text = r"\emph{could not be read:} " + _text(p["error"])
        body.append(rf"{_tt(name)} & {text} \\")
    lines += [_need_space(), r"\begingroup\footnotesize\setlength{\tabcolsep}{4pt}",
              *_longtable([(PROFILE_COLUMN, "l"), (1 - PROFILE_COLUMN, "l")], ["Profile", "Description"], body),
              r"\endgroup"]
    return lines, rest


def _cell(profile: dict, field: str, align: str) -> str:
    if "error" in profile or field not in profile:
        return DASH
    return _count(profile[field]) if align == "r" else _text(profile[field])


def _packages(entries: dict) -> tuple[list[str], Rows]:
    envs: dict[str, object] = {}
    if "packages" in entries:
        envs[MAIN_ENVIRONMENT] = entries["packages"]
    extra = entries.get("environments", {})
    rest: Rows = []
    if isinstance(extra, dict):
        envs.update({str(k): v for k, v in extra.items() if k != MAIN_ENVIRONMENT})
        if MAIN_ENVIRONMENT in extra:
            rest += _flatten(extra[MAIN_ENVIRONMENT], f"environments.{MAIN_ENVIRONMENT}")
    else:
        rest += _flatten(extra, "environments")
    n = 2 * PACKAGE_PAIRS
    body = []
    for env, packages in envs.items():
        key = "packages" if env == MAIN_ENVIRONMENT else f"environments.{env}"
        if not isinstance(packages, dict):
            rest += _flatten(packages, key)
            continue
        pairs = [(k, v) for k, v in packages.items() if k != "status" and not isinstance(v, dict | list)]
        rest += _rows([(f"{key}.{k}", v) for k, v in packages.items() if isinstance(v, dict | list)])
        notes = ([escape(ENVIRONMENT_LABELS[env])] if env in ENVIRONMENT_LABELS else []) + (
            [_text(packages["status"])] if "status" in packages else [])
        label = (": " + "; ".join(notes)) if notes else ""
        if body:
            body.append(r"\midrule")
        body.append(_span(n, rf"\textbf{{{_tt(env)}}}{label}"))
        for i in range(0, len(pairs), PACKAGE_PAIRS):
            chunk = pairs[i : i + PACKAGE_PAIRS]
            cells = [c for k, v in chunk for c in (_tt(k), _breakable(v))] + [""] * (n - 2 * len(chunk))
            body.append(" & ".join(cells) + r" \\")
    header = ["Package", "Version"] * PACKAGE_PAIRS
    columns = [(PACKAGE_SHARES[0], "l"), (PACKAGE_SHARES[1], "l")] * PACKAGE_PAIRS
    return (_longtable(columns, header, body) if body else []), rest


#: (heading, top-level keys, renderer, lines of room it needs at a page's foot or 0), in
#: the order the appendix prints them; the results' opening sentence takes three lines
SECTIONS: tuple[tuple[str, tuple[str, ...], Callable[[dict], tuple[list[str], Rows]], int], ...] = (
    ("Source", ("commit", "dirty", "created"), _source, 0),
    ("The host these results were made on", ("host",), _host, 0),
    ("Configuration", ("config_hash",), _configuration, ROOM_LINES),
    ("Where each result comes from", ("sources", "results"), _results, ROOM_LINES + 4),
    ("Hardware profiles", ("hardware",), _hardware, ROOM_LINES),
    ("Package versions", ("packages", "environments"), _packages, ROOM_LINES),
)


def render(manifest: dict) -> str:
    """LaTeX for a manifest: a section per known part (see the module's docstring), each
    table a ``longtable`` so that one longer than a page breaks across pages; then every
    entry the sections did not show, as dotted keys under *Other entries*."""
    lines = ["% generated by kvroute.analysis.manifest_tex from manifest.json; do not edit", DEFINE_NEED_SPACE,
             r"\begingroup\small",
             r"This appendix prints \texttt{results/manifest.json}, which the workflow's \texttt{manifest} rule "
             r"writes from the results these notes read; digests are shortened here and given in full there.", ""]
    other: Rows = []
    known = {k for _, keys, _, _ in SECTIONS for k in keys}
    for head, keys, section, room in SECTIONS:
        entries = {k: manifest[k] for k in keys if k in manifest}
        if not entries:
            continue
        body, rest = section(entries)
        other += rest
        if body:
            lines += [*([_need_space(room)] if room else []), rf"\subsection*{{{escape(head)}}}", *body, ""]
    for key, value in manifest.items():
        if key not in known:
            other += _flatten(value, str(key))
    if other:
        lines += [_need_space(ROOM_LINES + 1), r"\subsection*{Other entries}",
                  "Entries of the manifest that the layout above does not show, by their keys.", "",
                  *_longtable([(0.38, "l"), (0.62, "l")], ["Key", "Value"],
                              [rf"{_tt(k)} & {_tt(v)} \\" for k, v in other]), ""]
    lines.append(r"\endgroup")
    return "\n".join(lines) + "\n"


def write_manifest_tex(manifest_json: Path, out: Path) -> None:
    """Render ``manifest_json`` into ``out`` (atomically).

    Args:
        manifest_json: the workflow's results/manifest.json.
        out: where to write, e.g. results/manifest.tex (notes ``\\input{manifest.tex}``
            with results/ on TEXINPUTS).

    Raises:
        ValueError: the file does not hold a JSON object.
    """
    data = json.loads(Path(manifest_json).read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{manifest_json}: the manifest must be a JSON object")
    write_text(Path(out), render(data))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m kvroute.analysis.manifest_tex MANIFEST_JSON OUT_TEX", file=sys.stderr)
        return 2
    write_manifest_tex(Path(args[0]), Path(args[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
