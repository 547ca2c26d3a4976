"""envs/Containerfile, the Kubernetes profile's image, checked statically (no container engine
runs here): it copies files that exist, installs the locks the local environments come from,
TeX as the Makefile installs it, and the profile names the tag `make image` gives it.
"""

from __future__ import annotations

import hashlib
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CONTAINERFILE = ROOT / "envs/Containerfile"
PROFILE = ROOT / "workflow/profiles/kubernetes/config.yaml"
#: what IMAGE_ID hashes, in the Makefile's order (IMAGE_INPUTS)
IMAGE_INPUTS = ("envs/Containerfile", "envs/requirements.lock", "envs/cluster.lock", "envs/engine-gpu.lock")


def instructions(text: str) -> list[tuple[str, str, str]]:
    """(stage, INSTRUCTION, arguments) of a Containerfile, continuation lines joined."""
    out, stage, buf = [], "", ""
    for line in text.splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        buf += line.rstrip()
        if buf.endswith("\\"):
            buf = buf[:-1] + " "
            continue
        word, _, args = buf.strip().partition(" ")
        word, args, buf = word.upper(), " ".join(args.split()), ""
        if word == "FROM":
            m = re.search(r"\bAS\s+(\S+)$", args, re.I)
            stage = m.group(1) if m else args
        out.append((stage, word, args))
    return out


def _steps(word: str, stage: str | None = None) -> list[str]:
    return [a for s, w, a in instructions(CONTAINERFILE.read_text()) if w == word and stage in (None, s)]


def _make(*args: str) -> str:
    if shutil.which("make") is None:
        pytest.skip("make is missing (the project's commands are make targets)")
    return subprocess.run(["make", "-s", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout


def _makefile_var(name: str) -> str:
    m = re.search(rf"^{name}\s*[:?]?=\s*(.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert m, f"the Makefile defines no {name}"
    return m.group(1).strip()


def _apt_packages(command: str) -> set[str]:
    """The packages an `apt-get install` in ``command`` names (options left out)."""
    words = shlex.split(command.replace("&&", " && "))
    out, on = set(), False
    for prev, word in zip([""] + words, words):
        if prev == "apt-get" and word == "install":
            on = True
        elif word == "&&":
            on = False
        elif on and not word.startswith("-"):
            out.add(word)
    return out


def test_the_parser_reads_stages_and_continuations():
    got = instructions("FROM a:1 AS one\n# c\nRUN x \\\n    && y\nFROM one AS two\nCOPY f /t/\n")
    assert got == [("one", "FROM", "a:1 AS one"), ("one", "RUN", "x && y"), ("two", "FROM", "one AS two"),
                   ("two", "COPY", "f /t/")]


def test_every_copied_path_exists():
    copies = _steps("COPY")
    assert copies, "the Containerfile copies nothing"
    for args in copies:
        *sources, _dest = shlex.split(args)
        for src in sources:
            assert (ROOT / src).exists(), f"COPY {src}: no such file in the repository"


def test_the_locks_are_installed_from_the_copied_files():
    """Stage kvroute: the main and cluster locks, as `make cluster` installs .venv-cluster;
    stage gpu: the engine lock with --require-hashes (it is hashed)."""
    copied = {}
    for args in _steps("COPY"):
        *sources, dest = shlex.split(args)
        for src in sources:
            copied[src] = dest.rstrip("/") + "/" + Path(src).name if dest.endswith("/") else dest
    for stage, locks, hashed in (("kvroute", ("envs/requirements.lock", "envs/cluster.lock"), False),
                                 ("gpu", ("envs/engine-gpu.lock",), True)):
        installs = [part for run in _steps("RUN", stage) for part in run.split("&&") if "uv pip install" in part]
        for lock in locks:
            assert lock in copied, f"{lock} is not copied into the image"
            using = [p for p in installs if re.search(rf"(-r|--requirement)\s+{re.escape(copied[lock])}(\s|$)", p)]
            assert using, f"stage {stage} installs nothing with -r {copied[lock]} ({lock})"
            if hashed:
                assert all("--require-hashes" in p for p in using), f"{lock} is installed without --require-hashes"


def test_tex_and_uv_as_the_makefile_installs_them():
    tex = _apt_packages(_makefile_var("TEX_INSTALL"))
    assert {"latexmk", "texlive-science"} <= tex
    image = set().union(*(_apt_packages(run) for run in _steps("RUN", "kvroute")))
    assert tex <= image, f"the image lacks TeX packages the Makefile installs: {sorted(tex - image)}"
    uv = [m.group(1) for run in _steps("RUN", "kvroute") for m in re.finditer(r"\buv==(\S+)", run)]
    assert uv == [_makefile_var("UV_VERSION")], f"the image's uv {uv}, the Makefile's {_makefile_var('UV_VERSION')}"


def test_the_base_python_is_the_environments():
    base = _steps("FROM")[0]
    m = re.match(r"python:(\d+)\.(\d+)[.\d]*-", base)
    assert m, f"the first stage is not built on an official Python image: FROM {base}"
    envs = yaml.safe_load((ROOT / "envs/engine-gpu.yaml").read_text())["dependencies"]
    assert f"python={m.group(1)}.{m.group(2)}" in envs


def test_the_gpu_stage_points_kvroute_at_its_engine():
    envs = [a for a in _steps("ENV", "gpu") if a.startswith("KVROUTE_ENGINE_PYTHON=")]
    assert envs == ["KVROUTE_ENGINE_PYTHON=/opt/engine-gpu/bin/python"]
    assert any("--python /opt/engine-gpu/bin/python" in run for run in _steps("RUN", "gpu"))
    assert '"KVROUTE_ENGINE_PYTHON"' in (ROOT / "src/kvroute/live/engines.py").read_text()


def test_the_build_context_leaves_out_environments_and_results():
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".venv", ".venv-*", "results", ".git"} <= ignored


def test_the_profile_names_the_image_make_image_tags():
    image_id = _make("image-id").strip()
    digest = hashlib.sha256(b"".join((ROOT / p).read_bytes() for p in IMAGE_INPUTS)).hexdigest()[:12]
    assert image_id == digest, "IMAGE_ID is not the sha256 of IMAGE_INPUTS as docs/pipeline.md says"
    name, _, tag = yaml.safe_load(PROFILE.read_text())["container-image"].rpartition(":")
    assert tag in (image_id, f"{image_id}-gpu"), (
        f"workflow/profiles/kubernetes/config.yaml names tag {tag!r}; the image the Containerfile and "
        f"locks make now is {image_id} (`make image-id`): set container-image to {name}:{image_id}")
    build = _make("-n", "image", "IMAGE_TOOL=docker")
    assert f"docker build -f envs/Containerfile --target kvroute -t {name}:{image_id} ." in build, build
    assert _makefile_var("IMAGE_NAME") == name
