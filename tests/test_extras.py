"""Optional dependencies: one extra per feature, and errors that name the pip command."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from specfork.bench.hf import HFModels, build_hf_strategy
from specfork.bench.llamacpp import build_llamacpp_strategy
from specfork.bench.specs import parse_strategy
from specfork.config import SamplingParams
from specfork.extras import EXTRAS, MissingDependencyError, require

ROOT = Path(__file__).resolve().parents[1]


def _extras() -> dict[str, list[str]]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with (ROOT / "pyproject.toml").open("rb") as handle:
        return tomllib.load(handle)["project"]["optional-dependencies"]


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_every_optional_import_is_in_its_extra_and_in_test() -> None:
    extras = _extras()
    for extra in EXTRAS.values():
        assert extra.package in _names(extras[extra.extra]), extra
        if extra.extra != "llamacpp":  # compiled from source: not on CI
            assert extra.package in _names(extras["test"]), extra
    assert {"pytest", "build", "openai"} <= _names(extras["test"])


def _tiny_gguf(path: Path) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_require_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "accelerate", None)  # as if not installed
    with pytest.raises(MissingDependencyError) as caught:
        require("accelerate", "hf:ar")
    assert str(caught.value) == "hf:ar needs accelerate: pip install 'specfork[bench]'"


def test_hf_baseline_without_accelerate(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "accelerate", None)
    for label in ("hf:ar", "hf:prompt-lookup"):
        strategy = build_hf_strategy(
            parse_strategy(label),
            target_path=_tiny_gguf(tmp_path / "tiny.gguf"),
            models=HFModels(torch.float32, torch.device("cpu")),
            n=4,
            eos_ids=[0],
            sampling=SamplingParams(),
        )
        assert strategy.skipped and strategy.status == "skipped"
        assert strategy.error == f"{label} needs accelerate: pip install 'specfork[bench]'"


def test_llamacpp_baseline_without_llama_cpp(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    strategy = build_llamacpp_strategy(
        parse_strategy("llamacpp:ar"),
        target_path=_tiny_gguf(tmp_path / "tiny.gguf"),
        n=4,
        context=64,
        eos_ids=[0],
        sampling=SamplingParams(),
    )
    assert strategy.skipped
    assert strategy.error == "llamacpp:ar needs llama-cpp-python: pip install 'specfork[llamacpp]'"
