"""Hugging Face Hub model ids (`-m org/name[@revision][:QUANT]`), without the network.

The CLI runs in fresh processes (`cli_batch.py`) with huggingface_hub's own environment
variables, as a user sets them: HF_HUB_CACHE (a temporary cache), HF_HOME (no stored token),
HF_HUB_OFFLINE, and HF_ENDPOINT pointing at a local fake Hub (`fake_hub.py`) that serves a tiny
random-weight Llama checkpoint and a few tiny GGUF files.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from fake_hub import FakeHub, FakeRepo, serve
from specfork.errors import ConfigError
from specfork.loading.hub import HubRef, hub_label, select_gguf
from tiny_models import tiny_chat_llama

ROOT = Path(__file__).resolve().parents[1]
GENERATE = ["generate", "-n", "8", "--dtype", "float32", "--kernels", "off", "hello"]
COMMIT = "0123456789abcdef0123456789abcdef01234567"
GGUF_FILES = ("tiny-Q4_K_M.gguf", "tiny-Q4_K_S.gguf", "tiny-Q8_0.gguf", "mmproj-tiny-f16.gguf")


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_chat_llama(tmp_path_factory.mktemp("hub-src") / "tiny")


def _tiny_gguf(path: Path, name: str) -> bytes:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(name)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


@pytest.fixture(scope="module")
def hub(tiny: Path, tmp_path_factory: pytest.TempPathFactory):
    checkpoint = FakeRepo.from_folder(tiny, branches={"v1": COMMIT})
    checkpoint.files["README.md"] = b"# tiny\n"
    checkpoint.files["pytorch_model.bin"] = b"not fetched"
    folder = tmp_path_factory.mktemp("ggufs")
    ggufs = {name: _tiny_gguf(folder / name, name) for name in GGUF_FILES}
    gated = FakeRepo.from_folder(tiny, gated=True)
    repos = {
        "tiny-org/tiny-llama": checkpoint,
        "tiny-org/tiny-gguf": FakeRepo(files={**ggufs, "README.md": b"# ggufs\n"}),
        "tiny-org/gated": gated,
        "tiny-org/no-weights": FakeRepo(files={"README.md": b"x", "config.json": b"{}"}),
        "tiny-org/one-gguf": FakeRepo(files={"q/one-Q4_0.gguf": ggufs["tiny-Q8_0.gguf"]}),
    }
    with serve(FakeHub(repos)) as fake:
        yield fake


def _env(tmp_path: Path, endpoint: str, **extra: str) -> dict[str, str]:
    hub_vars = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_OFFLINE")
    env = {k: v for k, v in os.environ.items() if not k.startswith(hub_vars)}
    env.update(
        HF_HUB_CACHE=str(tmp_path / "hf-cache"),
        HF_HOME=str(tmp_path / "hf-home"),  # no stored token
        HF_ENDPOINT=endpoint,
        HF_HUB_DISABLE_TELEMETRY="1",
        SPECFORK_CACHE_DIR=str(tmp_path / "specfork-cache"),
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]),
    )
    env.update(extra)
    return env


def _batch(env: dict[str, str], *argvs: list[str], cwd: Path | None = None) -> list[dict]:
    """Each command line's {"code", "out", "err"}, run in one fresh process."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "cli_batch.py"), json.dumps(list(argvs))],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _one_line_error(result: dict, *words: str) -> str:
    assert result["code"] == 2, result
    assert result["out"] == "" and "Traceback" not in result["err"]
    lines = result["err"].strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specfork: error:"), result["err"]
    for word in words:
        assert word.lower() in lines[0].lower(), (word, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def expected(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """What the tiny checkpoint generates when its folder is passed directly."""
    env = _env(tmp_path_factory.mktemp("direct"), "http://127.0.0.1:9")
    (result,) = _batch(env, ["generate", "-m", str(tiny), *GENERATE[1:]])
    assert result["code"] == 0, result["err"]
    assert result["out"]
    return result["out"]


# ----------------------------------------------------------------------------- pure functions


def test_hub_ids_are_parsed() -> None:
    assert HubRef.parse("HuggingFaceTB/SmolLM2-135M-Instruct") == HubRef(
        "HuggingFaceTB/SmolLM2-135M-Instruct"
    )
    assert HubRef.parse("org/name@v1.0:Q4_K_M") == HubRef("org/name", "v1.0", "Q4_K_M")
    assert HubRef.parse("org/name@refs/pr/1") == HubRef("org/name", "refs/pr/1")
    assert HubRef.parse("org/name:model-q8_0.gguf") == HubRef("org/name", None, "model-q8_0.gguf")
    for not_an_id in ("smollm2", "./org/name", "/abs/path", "a/b/c", "org/na--me", "org/..", ""):
        assert HubRef.parse(not_an_id) is None, not_an_id
    with pytest.raises(ConfigError, match="not a Hugging Face repo id"):
        HubRef("no-slash")


def test_gguf_selection() -> None:
    files = ["a/tiny-Q4_K_M.gguf", "tiny-Q4_K_S.gguf", "tiny-q8_0.gguf", "tiny-Q8_0_L.gguf"]
    assert select_gguf("Q8_0", files) == "tiny-q8_0.gguf"  # a whole word wins over Q8_0_L
    assert select_gguf("q4_k_m", files) == "a/tiny-Q4_K_M.gguf"
    assert select_gguf("TINY-Q4_K_M.GGUF", files) == "a/tiny-Q4_K_M.gguf"  # by base name
    assert select_gguf("Q4_K", files) == ["a/tiny-Q4_K_M.gguf", "tiny-Q4_K_S.gguf"]
    assert select_gguf("Q5_K_M", files) == []


def test_hub_label() -> None:
    snap = Path("/c/models--org--my-model/snapshots") / COMMIT
    assert hub_label(snap) == "org/my-model"
    assert hub_label(snap / "q" / "m-Q8_0.gguf") == "org/my-model/q/m-Q8_0.gguf"
    assert hub_label(Path("/home/me/models/tiny")) is None


# ----------------------------------------------------------------------------- the CLI


def test_offline_cache_loads_like_the_folder(tiny: Path, expected: str, tmp_path: Path) -> None:
    """A checkpoint laid out in huggingface_hub's cache format loads with HF_HUB_OFFLINE=1."""
    storage = tmp_path / "hf-cache" / "models--tiny-org--cached"
    shutil.copytree(tiny, storage / "snapshots" / COMMIT)
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(COMMIT)
    env = _env(tmp_path, "http://127.0.0.1:9", HF_HUB_OFFLINE="1")
    run, missing = _batch(
        env,
        ["generate", "-m", "tiny-org/cached", *GENERATE[1:]],
        ["generate", "-m", "tiny-org/not-cached", *GENERATE[1:]],
    )
    assert run["code"] == 0, run["err"]
    assert run["out"] == expected
    assert "tiny-org/cached (float32" in run["err"]  # named by its repo, not the commit folder
    _one_line_error(missing, "tiny-org/not-cached", "HF_HUB_OFFLINE")


def test_download_then_load(hub: FakeHub, expected: str, tmp_path: Path) -> None:
    env = _env(tmp_path, hub.endpoint)
    run, models, listed = _batch(
        env,
        ["generate", "-m", "tiny-org/tiny-llama", *GENERATE[1:]],
        ["models"],
        ["models", "--json"],
    )
    assert run["code"] == 0, run["err"]
    assert run["out"] == expected
    assert "Fetching 5 files" in run["err"]  # huggingface_hub's progress bar
    snapshot = tmp_path / "hf-cache" / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT
    fetched = sorted(p.name for p in snapshot.iterdir())
    assert fetched == sorted(
        [
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
        ]
    )
    assert models["code"] == 0
    assert "tiny-org/tiny-llama" in models["out"] and COMMIT[:12] in models["out"]
    (row,) = json.loads(listed["out"])["hub"]
    assert row["repo_id"] == "tiny-org/tiny-llama" and row["revision"] == COMMIT
    assert row["refs"] == ["main"] and row["kind"] == "safetensors"
    assert row["size"] == sum(p.stat().st_size for p in snapshot.iterdir())
    assert row["models"] == ["tiny-org/tiny-llama"]

    hub.requests.clear()  # now offline: the cache alone serves the model
    (again,) = _batch(
        {**env, "HF_HUB_OFFLINE": "1"}, ["generate", "-m", "tiny-org/tiny-llama", *GENERATE[1:]]
    )
    assert again["code"] == 0, again["err"]
    assert again["out"] == expected
    assert not [r for r in hub.requests if "tiny-llama" in r]


def test_revision(hub: FakeHub, expected: str, tmp_path: Path) -> None:
    env = _env(tmp_path, hub.endpoint)
    tagged, unknown = _batch(
        env,
        ["generate", "-m", "tiny-org/tiny-llama@v1", *GENERATE[1:]],
        ["generate", "-m", "tiny-org/tiny-llama@nope", *GENERATE[1:]],
    )
    assert tagged["code"] == 0, tagged["err"]
    assert tagged["out"] == expected
    _one_line_error(unknown, "no revision 'nope'", "branch, tag or commit")


def test_bad_hub_ids_are_one_line_errors(hub: FakeHub, tmp_path: Path) -> None:
    # no-weights downloads its config first: without this, its progress bar precedes the error
    env = _env(tmp_path, hub.endpoint, HF_HUB_DISABLE_PROGRESS_BARS="1")
    unknown, gated, no_weights, ambiguous, none, no_gguf = _batch(
        env,
        ["generate", "-m", "tiny-org/nope", "hi"],
        ["generate", "-m", "tiny-org/gated", "hi"],
        ["generate", "-m", "tiny-org/no-weights", "hi"],
        ["generate", "-m", "tiny-org/tiny-gguf:Q4_K", "hi"],
        ["generate", "-m", "tiny-org/tiny-gguf:Q5_K_M", "hi"],
        ["generate", "-m", "tiny-org/tiny-llama:Q8_0", "hi"],
    )
    _one_line_error(unknown, "'tiny-org/nope'", "Hugging Face Hub", "HF_TOKEN")
    _one_line_error(gated, "tiny-org/gated", "gated", "HF_TOKEN", "login")
    _one_line_error(no_weights, "tiny-org/no-weights", "safetensors", "GGUF")
    line = _one_line_error(ambiguous, "matches 2 GGUF files", "tiny-Q4_K_M.gguf", "tiny-Q4_K_S")
    assert "Q8_0" not in line
    line = _one_line_error(none, "matches no GGUF file", "tiny-Q8_0.gguf", "tiny-Q4_K_M.gguf")
    assert "mmproj" not in line  # a vision projector is not a model to pick
    _one_line_error(no_gguf, "no GGUF files", "drop :Q8_0")


def test_gguf_repo(hub: FakeHub, tmp_path: Path) -> None:
    env = _env(tmp_path, hub.endpoint)
    by_quant, by_name, only, listed = _batch(
        env,
        ["@resolve", "tiny-org/tiny-gguf:q8_0"],
        ["@resolve", "tiny-org/tiny-gguf:tiny-Q4_K_S.gguf"],
        ["@resolve", "tiny-org/one-gguf"],  # the one GGUF file of a repo needs no :QUANT
        ["models", "--json"],
    )
    path = Path(by_quant["out"].strip())
    assert path.name == "tiny-Q8_0.gguf"
    assert path.read_bytes() == hub.repos["tiny-org/tiny-gguf"].files["tiny-Q8_0.gguf"]
    assert Path(by_name["out"].strip()).name == "tiny-Q4_K_S.gguf"
    downloaded = tmp_path / "hf-cache" / "models--tiny-org--tiny-gguf" / "snapshots" / COMMIT
    assert sorted(p.name for p in downloaded.iterdir()) == ["tiny-Q4_K_S.gguf", "tiny-Q8_0.gguf"]
    assert Path(only["out"].strip()).relative_to(tmp_path).parts[-2:] == ("q", "one-Q4_0.gguf")
    one, row = json.loads(listed["out"])["hub"]  # sorted by repo id
    assert one["models"] == ["tiny-org/one-gguf:one-Q4_0.gguf"]
    assert row["kind"] == "gguf"
    assert row["models"] == [
        "tiny-org/tiny-gguf:tiny-Q4_K_S.gguf",
        "tiny-org/tiny-gguf:tiny-Q8_0.gguf",
    ]

    (offline,) = _batch({**env, "HF_HUB_OFFLINE": "1"}, ["@resolve", "tiny-org/tiny-gguf:Q8_0"])
    assert Path(offline["out"].strip()) == path  # chosen among the cached files


def test_network_problems(tmp_path: Path) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    unreachable, offline = _batch(
        _env(tmp_path, closed),
        ["generate", "-m", "tiny-org/x", "hi"],
        ["generate", "-m", "tiny-org/x:Q8_0", "hi"],
    )
    _one_line_error(unreachable, "cannot reach the Hugging Face Hub", closed, "HF_HUB_OFFLINE")
    _one_line_error(offline, "cannot reach the Hugging Face Hub", "tiny-org/x:Q8_0")
    (nothing,) = _batch(
        _env(tmp_path, closed, HF_HUB_OFFLINE="1"), ["generate", "-m", "tiny-org/x:Q8_0", "hi"]
    )
    _one_line_error(nothing, "HF_HUB_OFFLINE")


def test_local_path_wins(hub: FakeHub, tiny: Path, expected: str, tmp_path: Path) -> None:
    """A folder spelled like a Hub id is loaded from disk; the Hub is not asked."""
    shutil.copytree(tiny, tmp_path / "tiny-org" / "tiny-gguf")
    hub.requests.clear()
    argv = ["generate", "-m", "tiny-org/tiny-gguf", *GENERATE[1:]]
    (run,) = _batch(_env(tmp_path, hub.endpoint), argv, cwd=tmp_path)
    assert run["code"] == 0, run["err"]
    assert run["out"] == expected
    assert not [r for r in hub.requests if "tiny-gguf" in r]
