"""The release: one version, a changelog, and a wheel and sdist that carry what they must."""

from __future__ import annotations

import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import specfork
from cli_run import run_cli
from specfork.bench.workloads import WORKLOADS
from specfork.heads.packaged import shipped

ROOT = Path(__file__).resolve().parents[1]
CSRC = sorted(
    p.name
    for p in (ROOT / "src" / "specfork" / "kernels" / "csrc").iterdir()
    if p.suffix in (".cpp", ".h")
)


def test_one_version(capsys: pytest.CaptureFixture[str]) -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^dynamic = \["version"\]', pyproject, re.MULTILINE)
    assert re.search(r'^version = \{ attr = "specfork.__version__" \}', pyproject, re.MULTILINE)
    assert not re.search(r'^version = "', pyproject, re.MULTILINE)  # no second copy
    with pytest.raises(SystemExit) as done:
        run_cli(capsys, ["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"specfork {specfork.__version__}"


def test_changelog() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    assert "[Keep a Changelog]" in text
    sections = re.findall(r"^## \[([^\]]+)\]", text, re.MULTILINE)
    assert sections[0] == "Unreleased"
    assert specfork.__version__ in sections


@pytest.mark.slow
def test_wheel_and_sdist(tmp_path: Path) -> None:
    """`python -m build` (fetches setuptools from PyPI into its isolated environment)."""
    done = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    version = specfork.__version__
    (wheel,) = tmp_path.glob(f"specfork-{version}-py3-none-any.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = archive.read(f"specfork-{version}.dist-info/METADATA").decode()
    assert {f"specfork/kernels/csrc/{name}" for name in CSRC} <= names
    assert "specfork/cli/__init__.py" in names and "specfork/loading/hub.py" in names
    assert {f"specfork/bench/workload_data/{w}.jsonl" for w in WORKLOADS} <= names
    assert f"specfork-{version}.dist-info/licenses/LICENSE" in names
    assert (
        "console_scripts"
        in zipfile.ZipFile(wheel).read(f"specfork-{version}.dist-info/entry_points.txt").decode()
    )
    assert f"\nVersion: {version}\n" in metadata
    assert "License-Expression: Apache-2.0" in metadata
    assert "Provides-Extra: bench" in metadata
    (sdist,) = tmp_path.glob(f"specfork-{version}.tar.gz")
    with tarfile.open(sdist) as archive:
        members = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    for name in ("README.md", "CHANGELOG.md", "LICENSE", "pyproject.toml", "docs/strategies.md"):
        assert name in members, name
    assert {f"src/specfork/kernels/csrc/{name}" for name in CSRC} <= members
    heads = {
        f"specfork/heads/packaged_heads/{model}/{name}"
        for model in shipped()
        for name in ("head.json", "head.safetensors")
    }
    assert heads and heads <= names  # the draft heads ship in the wheel
    assert {f"src/{name}" for name in heads} <= members  # and in the sdist
