"""`specfork generate --batch FILE`: many prompts through continuous batching, JSON lines out —
each text the one the prompt gets alone, in file order; bad files named by line, before the
model loads."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cli_run import run_cli
from specfork.config import GenerationConfig
from specfork.engine.generator import Generator
from specfork.loading.loader import load_model
from tiny_models import tiny_chat_llama


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_chat_llama(tmp_path_factory.mktemp("tiny-batch-cli"), seed=6)


def test_batch_file_outputs_equal_lone_generations(
    folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], one_thread
) -> None:
    system_chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    lines = [
        json.dumps("tell me a story"),
        "",
        json.dumps({"prompt": "abc abc abc"}),
        json.dumps({"messages": system_chat}),
    ]
    batch = tmp_path / "prompts.jsonl"
    batch.write_text("\ufeff" + "\n".join(lines) + "\n")  # an editor's BOM is not a prompt
    argv = [
        "generate",
        "-m",
        str(folder),
        "--batch",
        str(batch),
        "-n",
        "8",
        "--ignore-eos",
        "--max-running",
        "2",
        "--strategy",
        "speculative",
        "--drafter",
        "ngram",
    ]
    code, out, err = run_cli(capsys, argv)
    assert code == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["index"] for r in records] == [0, 1, 2]
    assert all(r["completion_tokens"] == 8 and r["finish_reason"] == "length" for r in records)
    gen = Generator(load_model(str(folder), progress=False))
    config = GenerationConfig(max_new_tokens=8, ignore_eos=True)
    chats = [
        [{"role": "user", "content": "tell me a story"}],
        [{"role": "user", "content": "abc abc abc"}],
        system_chat,
    ]
    assert [r["text"] for r in records] == [gen.generate(c, config=config).text for c in chats]
    assert "3 prompts, 24 tokens" in " ".join(err.split())  # the console may wrap the line
    out_file = tmp_path / "out.jsonl"
    code, out, _ = run_cli(capsys, [*argv, "--output", str(out_file), "--stats", "-q"])
    assert code == 0 and out == ""
    written = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert [r["text"] for r in written] == [r["text"] for r in records]
    assert written[0]["stats"]["new_tokens"] == 8


@pytest.mark.parametrize(
    ("content", "extra", "message"),
    [
        ("not json\n", [], r"b\.jsonl:1: not valid JSON .*expected a JSON string"),
        ('"fine"\n{"prompt": 3}\n', [], r"b\.jsonl:2: the prompt .* must be a string, got int"),
        ('{"messages": []}\n', [], "'messages' must be a non-empty list"),
        ('{"prompt": "x", "max_tokens": 5}\n', [], r"b\.jsonl:1: key\(s\) 'max_tokens'.*flags"),
        ('{"prompt": "x", "messages": [{"role": "user", "content": "y"}]}\n', [], "not both"),
        ('{"messages": [{"role": "wizard", "content": "y"}]}\n', [], r"role 'wizard' is not"),
        ('{"messages": [{"role": "user", "content": 3}]}\n', [], r"messages\[0\] must be an"),
        ('{"messages": [{"role": "user", "content": "y", "name": "a"}]}\n', [], "'name'"),
        ('{"messages": [{"role": "user", "content": " "}]}\n', [], "every message is empty"),
        ('"  "\n', [], r"b\.jsonl:1: the prompt must be a non-empty string"),
        ("\n\n", [], "holds no prompts"),
        ('"hi"\n', ["a prompt too"], "either a prompt or --batch"),
        ('"hi"\n', ["--trace", "t.jsonl"], "--trace reports one request"),
        ('"hi"\n', ["--max-running", "0"], "max_running must be an integer >= 1"),
        ('"hi"\n', ["--max-running", "8", "--step-rows", "4"], "raise step_rows or lower"),
        ('{"messages": [{"role": "user", "content": "x"}]}\n', ["--no-chat"], "need chat mode"),
        ('"hi"\n', ["--no-chat", "--system", "be brief"], "--system is a chat message"),
    ],
)
def test_bad_batch_files_and_flags_are_one_line_errors(
    folder: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    content: str,
    extra: list[str],
    message: str,
) -> None:
    batch = tmp_path / "b.jsonl"
    batch.write_text(content)
    extra = [str(tmp_path / x) if x == "t.jsonl" else x for x in extra]
    argv = ["generate", "-m", str(folder), "--batch", str(batch), "-n", "2", *extra]
    if extra and extra[0] == "a prompt too":
        argv = ["generate", "a prompt too", "-m", str(folder), "--batch", str(batch)]
    code, out, err = run_cli(capsys, argv)
    assert code == 2 and out == ""
    assert "Traceback" not in err
    assert re.search(message, err), err
    assert not (tmp_path / "t.jsonl").exists()  # a refused run leaves no trace file behind


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["-o", "out.jsonl"], "--output/-o is a flag of --batch"),
        (["--max-running", "4"], "--max-running is a flag of --batch"),
        (["--step-rows", "64"], "--step-rows is a flag of --batch"),
        (["--no-chat", "--system", "be brief"], "--system is a chat message"),
    ],
)
def test_flags_a_single_prompt_would_ignore_are_refused(
    folder: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    message: str,
) -> None:
    argv = ["generate", "-m", str(folder), "-n", "2", *extra, "hello"]
    code, out, err = run_cli(capsys, argv)
    assert code == 2 and out == "" and message in err, err
    assert "Traceback" not in err


def test_results_never_replace_the_batch_file(
    folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    batch = tmp_path / "b.jsonl"
    batch.write_text('"hello"\n')
    link = tmp_path / "link.jsonl"
    link.symlink_to(batch)
    for output in (batch, link):  # the same file under its name and through a link
        argv = ["generate", "-m", str(folder), "--batch", str(batch), "-o", str(output)]
        code, out, err = run_cli(capsys, argv)
        assert out == ""
        assert code == 2 and "is the --batch file" in err, err
    assert batch.read_text() == '"hello"\n'
