"""The README's code runs as written and every relative link in the docs
resolves.

README convention: every ```python block runs, in order, in one process
(later blocks use names from earlier ones), on the CPU, from the repository
root. A block that cannot run there (it needs a GPU, the published Hub
repository or several processes) is preceded by the line
``<!-- not run: <reason> -->``; ```bash blocks are shell commands and are
not run (scripts/test.sh and .ci/run exercise them).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
NOT_RUN = "<!-- not run:"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "maxsim-metal" / "README.md"]


def readme_blocks() -> list[tuple[str, str, bool]]:
    """-> (language, code, runs) for each fenced block of the README."""
    text = (ROOT / "README.md").read_text()
    blocks = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip().splitlines()
        skipped = bool(before) and before[-1].startswith(NOT_RUN)
        blocks.append((m.group(1), m.group(2), m.group(1) == "python" and not skipped))
    return blocks


def test_readme_blocks_are_marked():
    blocks = readme_blocks()
    assert any(runs for _, _, runs in blocks), "no runnable README block"
    for lang, code, _ in blocks:
        assert lang in ("python", "bash"), f"README block without a known language: {code[:80]!r}"


def test_readme_python_blocks_run():
    script = "\n\n".join(code for _, code, runs in readme_blocks() if runs)
    env = dict(os.environ, HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, f"README code failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"


def _links(path):
    text = FENCE.sub("", path.read_text())
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(doc):
    assert doc.exists(), doc
    broken = []
    for link in _links(doc):
        if re.match(r"^[a-z]+:", link) or link.startswith("#"):
            continue
        target = (doc.parent / link.split("#")[0]).resolve()
        if not target.exists():
            broken.append(link)
    assert not broken, f"{doc.name}: broken links {broken}"


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
    assert len((ROOT / "docs" / "performance.md").read_text().splitlines()) <= 300


def test_rendered_tables_are_current():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "render.py"), "--check"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr + r.stdout
