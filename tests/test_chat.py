"""Multi-turn chat (engine/chat.py, `specfork chat`): every turn's reply is what a fresh request
on the same messages gives (the prefix cache reuses earlier turns without changing a token),
the conversation drops its oldest exchanges when the context is full, and the command reads
turns and /commands from stdin."""

from __future__ import annotations

import io
import itertools
import sys
from pathlib import Path

import pytest

from cli_run import run_cli
from specfork.config import GenerationConfig, SpecConfig
from specfork.engine.chat import ChatSession
from specfork.engine.generator import Generator
from specfork.errors import ConfigError, PromptError
from specfork.kernels import load_kernels
from specfork.loading.loader import LoadedModel, load_model
from specfork.models.cost import CostCurve
from tiny_models import tiny_chat_llama

KERNELS = load_kernels() is not None
CURVE = CostCurve((1, 2, 4, 8, 16, 32), (1.0, 1.25, 1.5, 2.3, 3.9, 6.8))  # fixed: reproducible
MESSAGES = ["the cat sat on the mat", "and then the cat sat on the mat again", "why?"]
CONFIG = GenerationConfig(max_new_tokens=12, ignore_eos=True)
STRATEGIES = {
    "ar": SpecConfig(),
    "ngram": SpecConfig("speculative", "ngram", k=4),
    "spork": SpecConfig("spork", "recycle+ngram"),
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_chat_llama(tmp_path_factory.mktemp("tiny-chat"), seed=5)


@pytest.fixture(scope="module")
def loaded(folder: Path, one_thread) -> LoadedModel:
    return load_model(str(folder), dtype="float32", kernels=KERNELS, progress=False)


def _turns(session: ChatSession, messages: list[str]) -> list[str]:
    replies = []
    for text in messages:
        stream = session.send(text)
        replies.append("".join(stream))
        assert stream.result is not None
    return replies


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_each_turn_is_a_fresh_request_on_the_conversation(loaded: LoadedModel, name: str) -> None:
    spec = STRATEGIES[name]
    session = ChatSession(Generator(loaded, spec=spec, cost_curve=CURVE), config=CONFIG)
    replies = _turns(session, MESSAGES)
    fresh = Generator(loaded, spec=spec, cost_curve=CURVE)
    messages: list[dict[str, str]] = []
    for text, reply in zip(MESSAGES, replies, strict=True):
        messages.append({"role": "user", "content": text})
        expected = fresh.generate(messages, chat=True, config=CONFIG)
        assert reply == expected.text
        messages.append({"role": "assistant", "content": reply})
    assert session.messages() == messages
    assert [t.user for t in session.turns] == MESSAGES


@pytest.mark.skipif(not KERNELS, reason="the prefix cache is on for batch-invariant models")
def test_later_turns_reuse_the_earlier_turns_kv(loaded: LoadedModel) -> None:
    session = ChatSession(Generator(loaded, cost_curve=CURVE), config=CONFIG)
    _turns(session, MESSAGES)
    stats = [t.result.stats for t in session.turns]
    assert stats[0].cached_prompt_tokens == 0
    for before, now in itertools.pairwise(stats):  # at least the previous turn's whole prompt
        assert before.prompt_tokens <= now.cached_prompt_tokens < now.prompt_tokens


def test_reset_and_system_message(loaded: LoadedModel) -> None:
    session = ChatSession(Generator(loaded), system="be brief", config=CONFIG)
    _turns(session, MESSAGES[:2])
    assert session.messages()[0] == {"role": "system", "content": "be brief"}
    assert len(session.messages()) == 5
    session.reset()
    assert session.messages() == [{"role": "system", "content": "be brief"}]
    assert session.messages("hi")[-1] == {"role": "user", "content": "hi"}


def test_a_full_context_drops_the_oldest_exchanges(loaded: LoadedModel) -> None:
    generator = Generator(loaded, max_context=160)
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    session = ChatSession(generator, config=config)
    for i in range(6):
        stream = session.send(f"message number {i}, a few words long")
        "".join(stream)
        assert stream.result is not None
        assert len(stream.result.prompt_ids) + 24 <= 160 or session.dropped == i
    assert session.dropped > 0
    kept = session.messages()
    assert kept[0]["content"] == f"message number {session.dropped}, a few words long"
    assert len(session.turns) == 6  # the history keeps every exchange; the prompt drops them


def test_bad_input(loaded: LoadedModel, tmp_path: Path) -> None:
    session = ChatSession(Generator(loaded), config=CONFIG)
    for text in ("", "   \n"):
        with pytest.raises(PromptError, match="needs some text"):
            session.send(text)
    with pytest.raises(ConfigError, match="non-empty string"):
        ChatSession(Generator(loaded), system="  ")
    plain = tiny_chat_llama(tmp_path / "no-template", chat=False)
    no_chat = load_model(str(plain), dtype="float32", kernels=KERNELS, progress=False)
    with pytest.raises(ConfigError, match="no chat template"):
        ChatSession(Generator(no_chat))


# ----------------------------------------------------------------------------- the command


def _chat(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    folder: Path,
    stdin: str,
    *flags: str,
) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    argv = ["chat", "-m", str(folder), "--dtype", "float32", "-n", "12", "-q", *flags]
    return run_cli(capsys, argv)


def test_the_command_writes_one_reply_per_turn(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    folder: Path,
    loaded: LoadedModel,
) -> None:
    lines = "the cat sat\n\n/stats\nand on the \\\nmat?\n/history\n/nonsense\n/reset\nhi\n"
    code, out, err = _chat(capsys, monkeypatch, folder, lines, "--strategy", "spork")
    assert code == 0
    config = GenerationConfig(max_new_tokens=12)
    session = ChatSession(Generator(loaded, spec=SpecConfig("spork", "recycle+ngram")))
    session.config = config
    expected = _turns(session, ["the cat sat", "and on the \nmat?"])
    session.reset()
    expected += _turns(session, ["hi"])
    assert out == "".join(f"{reply}\n" for reply in expected)
    assert err.count("tokens/forward") == 2  # /stats: the second and third turns
    assert "user: and on the \nmat?" in err  # /history
    assert "unknown command /nonsense" in err
    assert "(a new conversation)" in err


def test_the_command_refuses_bad_flags_before_loading(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    missing = tmp_path / "nothing-here"
    code, out, err = _chat(capsys, monkeypatch, missing, "hi\n", "--system", " ")
    assert code == 2 and out == ""
    assert "--system is empty" in err


@pytest.mark.parametrize(
    ("flags", "words"),
    [(["--chat"], "drop --chat, or give --no-chat"), (["--system", "be brief"], "--no-chat")],
)
def test_chat_flags_on_a_model_without_a_template_name_the_fix(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, flags: list[str], words: str
) -> None:
    folder = tiny_chat_llama(tmp_path / "base", chat=False)
    argv = ["generate", "-m", str(folder), "--dtype", "float32", "-n", "4", *flags, "hi"]
    code, out, err = run_cli(capsys, argv)
    assert code == 2 and out == ""
    assert "has no chat template" in err and words in err


@pytest.mark.parametrize(
    ("command", "shown"),
    [
        ("generate", "-n MAX_NEW_TOKENS tokens to generate at most (default: 256)"),
        ("chat", "-n MAX_NEW_TOKENS per reply (512)"),
        ("generate", "--dtype {auto,float32,bfloat16,float16,gguf} precision: gguf"),
    ],
)
def test_help_shows_defaults(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, command: str, shown: str
) -> None:
    from specfork.cli import build_parser

    monkeypatch.setenv("COLUMNS", "2000")  # argparse wraps at the terminal's width
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert shown in text
    assert "(default: None)" not in text and "(default: False)" not in text
    if command == "generate":
        assert "auto = fastest (default: auto)" in text


def test_structured_output_cut_by_the_limit_says_so(
    capsys: pytest.CaptureFixture[str], folder: Path
) -> None:
    """Even with -q: the output is not what --json promised, and stdout holds only it."""
    argv = ["generate", "-m", str(folder), "--dtype", "float32", "-q", "--json", "-n", "1", "hi"]
    code, out, err = run_cli(capsys, argv)
    assert code == 0
    text = out.removesuffix("\n")
    assert text.startswith("{") and len(text) > 0
    assert "stopped at -n 1 before its json_object structure was complete" in err
    code, out, err = run_cli(capsys, [*argv[:5], "-n", "3", "hi"])  # no constraint: no warning
    assert code == 0 and "structure" not in err
