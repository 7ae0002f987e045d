"""One prompt-file reader for every command: each format, each error, and one file that
`generate --batch`, `bench` and `calibrate` all take."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cli_run import run_cli
from specfork.bench.prompt_file import BenchPrompt, load_prompts
from specfork.bench.report import load_results
from specfork.errors import PromptError
from tiny_models import tiny_chat_llama

SYSTEM = {"role": "system", "content": "Be brief."}


def _write(path: Path, rows: list) -> Path:
    """One JSON value a line; "" is a blank line."""
    path.write_text("".join((json.dumps(r) if r != "" else "") + "\n" for r in rows))
    return path


MIXED = [
    "Name three colours.",
    "",
    {"prompt": "abc abc abc abc", "category": "copy"},
    {"question_id": 81, "category": "writing", "turns": ["Write a line.", "Shorter."]},
    {"messages": [SYSTEM, {"role": "user", "content": "Count to five."}], "category": "chat"},
    {"system": "Answer in JSON.", "turns": ["Give a name."], "question_id": "s1"},
    {"turns": ["Say hi."], "reference": ["hi"], "source_ids": [1, 2]},  # metadata is ignored
]


def test_every_json_format(tmp_path: Path) -> None:
    string, prompt, turns, messages, system, meta = load_prompts(
        _write(tmp_path / "p.jsonl", MIXED)
    )
    assert string == BenchPrompt(1, "uncategorized", "Name three colours.")
    assert (prompt.question_id, prompt.category, prompt.text) == (3, "copy", "abc abc abc abc")
    assert turns.turns == ("Write a line.", "Shorter.") and turns.question_id == 81
    assert turns.first_prompt() == "Write a line." and not turns.chat
    assert messages.chat and messages.context == (SYSTEM,) and messages.text == "Count to five."
    assert messages.first_prompt() == [SYSTEM, {"role": "user", "content": "Count to five."}]
    assert system.chat and system.question_id == "s1"
    assert system.first_messages(" Now.") == [
        {"role": "system", "content": "Answer in JSON."},
        {"role": "user", "content": "Give a name. Now."},
    ]
    assert system.to_dict()["context"] == [{"role": "system", "content": "Answer in JSON."}]
    assert meta.text == "Say hi." and meta.category == "uncategorized"


def test_messages_keep_their_roles(tmp_path: Path) -> None:
    chat = [
        {"role": "developer", "content": "Rules."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! Go on:"},
    ]
    (p,) = load_prompts(_write(tmp_path / "m.jsonl", [{"messages": chat}]))
    assert (
        p.role == "assistant" and p.text == "Hello! Go on:" and p.to_dict()["role"] == "assistant"
    )
    assert p.first_prompt()[0] == {"role": "system", "content": "Rules."}  # developer = system


def test_plain_text_and_format_detection(tmp_path: Path) -> None:
    text = tmp_path / "p.txt"
    text.write_text('\ufeff"Quoted" first.\n\n  {braces} too\n')
    assert [(p.question_id, p.text, p.category) for p in load_prompts(text)] == [
        (1, '"Quoted" first.', "text"),
        (3, "{braces} too", "text"),
    ]
    bare = tmp_path / "prompts"  # no suffix: JSON when the first line is JSON
    bare.write_text('"a JSON string"\n{"prompt": "b"}\n')
    assert [p.text for p in load_prompts(bare)] == ["a JSON string", "b"]
    bare.write_text('"Quoted" words are text\nmore\n')
    assert [p.text for p in load_prompts(bare)] == ['"Quoted" words are text', "more"]
    bare.write_text("{not json\n")  # starts like JSON: read as JSON, so the mistake is shown
    with pytest.raises(PromptError, match=r"prompts:1: not valid JSON"):
        load_prompts(bare)


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("{not json", "not valid JSON .*expected a JSON string"),
        ("3", "got a JSON int"),
        ('["a", "list"]', "got a JSON list"),
        ('"  "', "the prompt must be a non-empty string"),
        ('{"prompt": 3}', r"the prompt \(first turn\) must be a string, got int"),
        ('{"turns": []}', "'turns' must be a non-empty list"),
        ('{"turns": "one"}', "'turns' must be a non-empty list"),
        ('{"turns": ["ok", ""]}', "turn 2 must be a non-empty string"),
        ('{"question": "x"}', "no prompt; expected"),
        ('{"prompt": "x", "turns": ["y"]}', "give one of 'prompt', 'turns' and 'messages'"),
        ('{"prompt": "x", "temperature": 0.5}', r"key\(s\) 'temperature' set how to generate"),
        ('{"turns": ["x"], "max_tokens": 5, "seed": 1}', r"'max_tokens', 'seed'.*flags"),
        ('{"prompt": "x", "category": 5}', "'category' must be a non-empty string"),
        ('{"prompt": "x", "question_id": true}', "'question_id' must be a string or"),
        ('{"prompt": "x", "system": ""}', "'system' must be a non-empty string"),
        ('{"messages": [{"role": "user", "content": "x"}], "system": "s"}', "first message"),
        ('{"messages": []}', "'messages' must be a non-empty list"),
        ('{"messages": ["hi"]}', r"messages\[0\] must be an object with role and content"),
        ('{"messages": [{"role": "user", "content": "x", "name": "a"}]}', "unknown key.*'name'"),
        ('{"messages": [{"role": "tool", "content": "x"}]}', "role 'tool' is not supported"),
        ('{"messages": [{"role": "user", "content": " "}]}', "every message is empty"),
    ],
)
def test_bad_lines_name_file_line_and_fix(tmp_path: Path, line: str, words: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(f'"fine"\n\n{line}\n')
    with pytest.raises(PromptError, match=rf"bad\.jsonl:3: .*{words}"):
        load_prompts(path)


def test_unreadable_or_empty_files(tmp_path: Path) -> None:
    with pytest.raises(PromptError, match="cannot read the prompt file"):
        load_prompts(tmp_path / "missing.jsonl")
    binary = tmp_path / "b.jsonl"
    binary.write_bytes(b"\xc1\xff\n")
    with pytest.raises(PromptError, match="cannot read the prompt file"):
        load_prompts(binary)
    empty = tmp_path / "e.txt"
    empty.write_text("\n  \n")
    with pytest.raises(PromptError, match="holds no prompts"):
        load_prompts(empty)


# ----------------------------------------------------------------------------- every command


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_chat_llama(tmp_path_factory.mktemp("tiny-prompt-file"), seed=3)


@pytest.mark.usefixtures("one_thread")
def test_one_file_in_generate_bench_and_calibrate(
    folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path / "mixed.jsonl", MIXED)
    model = ["-m", str(folder), "--dtype", "float32", "--device", "cpu"]
    code, out, err = run_cli(
        capsys, ["generate", *model, "--batch", str(path), "-n", "4", "--ignore-eos"]
    )
    assert code == 0, err
    assert [json.loads(line)["index"] for line in out.splitlines()] == list(range(6))
    assert "1 prompt(s)" in " ".join(err.split()) and "first turn" in err
    bench = ["bench", *model, "--prompts", str(path), "-n", "4", "--ignore-eos", "--repeats", "1"]
    bench += ["--warmup", "0", "--turns", "all", "-q", "--no-plots", "-o", str(tmp_path / "out")]
    code, _, err = run_cli(capsys, [*bench, "--strategies", "ar,speculative:ngram?k=2"])
    assert code == 0, err
    doc = load_results(tmp_path / "out")
    assert [(p["question_id"], p["turn"]) for p in doc["prompts"]] == [
        (1, 1),
        (3, 1),
        (81, 1),
        (81, 2),
        (5, 1),
        ("s1", 1),
        (7, 1),
    ]
    system_prompt = next(p for p in doc["prompts"] if p["question_id"] == 5)
    assert system_prompt["context"] == [SYSTEM]
    code, out, err = run_cli(
        capsys, ["calibrate", *model, "--prompts", str(path), "-n", "24", "--json"]
    )
    assert code == 0, err
    assert json.loads(out)["prompts"] == 6


@pytest.mark.parametrize("command", ["generate", "bench", "calibrate"])
def test_a_bad_line_is_the_same_error_in_every_command(
    folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('"ok"\n{"prompt": "x", "top_p": 0.9}\n')
    argv = {
        "generate": ["generate", "-m", str(folder), "--batch", str(path)],
        "bench": ["bench", "-m", str(folder), "--prompts", str(path), "-o", str(tmp_path)],
        "calibrate": ["calibrate", "-m", str(folder), "--prompts", str(path)],
    }[command]
    code, out, err = run_cli(capsys, argv)
    assert code == 2 and out == "" and "Traceback" not in err
    assert re.search(r"bad\.jsonl:2: key\(s\) 'top_p' set how to generate", " ".join(err.split()))


@pytest.mark.parametrize("command", ["bench", "calibrate"])
def test_chat_prompts_need_a_chat_template(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    plain = tiny_chat_llama(tmp_path / "plain", chat=False)
    path = _write(tmp_path / "chat.jsonl", ["text is fine", {"system": "s", "prompt": "hi"}])
    model = ["-m", str(plain), "--dtype", "float32", "--device", "cpu", "-n", "2"]
    argv = {
        "bench": ["bench", *model, "--prompts", str(path), "-q", "-o", str(tmp_path / "out")],
        "calibrate": ["calibrate", *model, "--prompts", str(path)],
    }[command]
    code, out, err = run_cli(capsys, argv)
    assert code == 2 and out == "" and "Traceback" not in err
    assert "prompt(s) 2 " in err and "no chat template" in " ".join(err.split()), err


@pytest.mark.usefixtures("one_thread")
def test_a_text_file_in_generate_and_calibrate(
    folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "prompts.txt"
    path.write_text('First prompt.\n\n"Quoted" second {with braces}\n')
    model = ["-m", str(folder), "--dtype", "float32", "--device", "cpu"]
    code, out, err = run_cli(capsys, ["generate", *model, "--batch", str(path), "-n", "3"])
    assert code == 0, err
    assert [json.loads(line)["index"] for line in out.splitlines()] == [0, 1]
    assert "first turn" not in err  # no conversations: no note
    argv = ["calibrate", *model, "--prompts", str(path), "-n", "24", "--json"]
    code, out, err = run_cli(capsys, argv)
    assert code == 0, err
    assert json.loads(out)["prompts"] == 2
