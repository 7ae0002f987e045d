"""The Python API's arguments of the wrong kind: a ConfigError or PromptError that names the
argument and what it takes, never a TypeError or AttributeError from deep inside."""

from __future__ import annotations

import logging

import numpy
import pytest
import torch

from specfork import load_model
from specfork.config import GenerationConfig
from specfork.engine.generator import Generator
from specfork.errors import ConfigError, PromptError
from specfork.loading.loader import LoadedModel
from tiny_models import tiny_chat_llama

CONFIG = GenerationConfig(max_new_tokens=2, ignore_eos=True)
# SmolLM2's way of writing a turn: text joined with `+`, which a number cannot join
ADDING_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\\n{% endif %}"
)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(
        str(tiny_chat_llama(tmp_path_factory.mktemp("tiny-api"), seed=3)), progress=False
    )


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"max_context": -5}, "max_context must be an integer >= 2, got -5"),
        ({"max_context": 1}, "max_context must be an integer >= 2"),
        ({"max_context": 2.5}, "max_context must be an integer"),
        ({"prefill_chunk": 0}, "prefill_chunk must be an integer >= 1"),
        ({"max_strategies": True}, "max_strategies must be an integer"),
        ({"spec": "ngram"}, "spec must be a SpecConfig, got str"),
    ],
)
def test_generator_arguments_are_checked(loaded: LoadedModel, kwargs: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        Generator(loaded, **kwargs)


def test_a_model_name_is_not_a_loaded_model() -> None:
    with pytest.raises(ConfigError, match=r"got str; write Generator\(load_model\(name\)\)"):
        Generator("smollm2-135m-instruct")  # type: ignore[arg-type]


@pytest.mark.parametrize("prompt", [5, None, b"hello", 2.5])
def test_a_prompt_of_another_kind_is_a_prompt_error(loaded: LoadedModel, prompt: object) -> None:
    with pytest.raises(PromptError, match="a prompt is a string, a list of chat messages"):
        Generator(loaded).generate(prompt, config=CONFIG)  # type: ignore[arg-type]


def test_a_number_the_template_cannot_join_is_a_prompt_error(loaded: LoadedModel) -> None:
    gen = Generator(loaded)
    messages = [{"role": "user", "content": "hello"}]
    with_template = gen.tokenizer.chat_template
    try:
        gen.tokenizer.chat_template = ADDING_TEMPLATE
        assert gen.generate(messages, config=CONFIG).token_ids  # strings render
        with pytest.raises(PromptError, match="string role and string content"):
            gen.generate([{"role": "user", "content": 5}], config=CONFIG)
    finally:
        gen.tokenizer.chat_template = with_template


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"stop": None}, ((), ())),  # as OpenAI's "stop": null
        ({"stop_token_ids": None}, ((), ())),
        ({"stop": "END"}, (("END",), ())),
        ({"stop": ["a", "b"], "stop_token_ids": (7,)}, (("a", "b"), (7,))),
    ],
)
def test_stop_conditions_take_none_one_or_many(kwargs: dict, expected: tuple) -> None:
    config = GenerationConfig(**kwargs)
    assert (config.stop, config.stop_token_ids) == expected


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"stop": 5}, "stop must be a list of stop strings, got 5"),
        ({"stop": b"END"}, "stop must be a list of stop strings"),
        ({"stop_token_ids": "12"}, "stop_token_ids must be a list of stop token ids"),
        ({"stop_token_ids": 12}, "stop_token_ids must be a list"),
        ({"stop": [""]}, "non-empty strings"),
    ],
)
def test_stop_conditions_of_another_kind_are_refused(kwargs: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        GenerationConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"config": {"max_new_tokens": 3}}, "config must be a GenerationConfig or None, got dict"),
        ({"sampling": {"temperature": 1.0}}, "sampling must be a SamplingParams or None, got dict"),
        ({"spec": "spork"}, "spec must be a SpecConfig or None, got str"),
    ],
)
def test_request_arguments_of_another_kind_are_config_errors(
    loaded: LoadedModel, kwargs: dict, words: str
) -> None:
    gen = Generator(loaded)
    for call in (gen.generate, gen.stream, gen.open_request):
        with pytest.raises(ConfigError, match=words):
            call("hello", **kwargs)
    with pytest.raises(ConfigError, match="use_strategy takes a SpecConfig, got NoneType"):
        gen.use_strategy(None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="release takes a Request"):
        gen.release(None)  # type: ignore[arg-type]


def test_token_ids_of_any_integer_kind_are_a_prompt(loaded: LoadedModel) -> None:
    gen = Generator(loaded)
    ids = [1, 2, 3]
    want = gen.generate(ids, config=CONFIG).token_ids
    for same in (tuple(ids), list(torch.tensor(ids)), [numpy.int64(i) for i in ids]):
        assert gen.generate(same, config=CONFIG).token_ids == want


@pytest.mark.parametrize(
    ("prompt", "words"),
    [
        ([1.5], r"prompt element 0 is 1.5 \(float\)"),
        ([1, "a"], r"prompt element 1 is 'a' \(str\)"),
        ([1, True], r"prompt element 1 is True \(bool\)"),
        ([1, torch.tensor(True)], r"prompt element 1 is tensor\(True\)"),
        ([torch.tensor([7])], r"prompt element 0 is tensor\(\[7\]\).*ids.tolist\(\)"),
        ([1, "x" * 100_000], r"prompt element 1 is 'xxxx.*\.\.\..*' \(str\)"),  # shortened
        ((-1, 5), r"prompt token ids must be in \[0, "),
    ],
)
def test_bad_token_ids_name_the_element(loaded: LoadedModel, prompt: object, words: str) -> None:
    with pytest.raises(PromptError, match=words):
        Generator(loaded).generate(prompt, config=CONFIG)  # type: ignore[arg-type]


def test_a_max_context_beyond_the_model_is_capped_with_a_warning(
    loaded: LoadedModel, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="specfork.engine"):
        gen = Generator(loaded, max_context=10**6)
    assert gen.context == loaded.config.max_position
    assert "max_context 1000000 is beyond what" in caplog.text
