"""Task prompts for head data (`specfork.tools.task_prompts`) and the data settings they use."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from specfork.errors import ConfigError
from specfork.tools.head_data import DataConfig
from specfork.tools.task_prompts import CONTEXT_CHARS, TASKS, load_corpus, task_prompt, task_prompts

MODULE = '''\
"""{name}: a module for testing task prompts.

It holds a handful of documented functions. Their docstrings are long enough to be pasted into
a prompt, and their bodies are long enough to be explained. This paragraph makes the module's
own documentation long enough to be summarised as well.
"""


def public_{name}(x, y=2):
    """Return the sum of x and y, scaled by a constant factor of three.

    Both arguments must be numbers; a string raises TypeError.
    """
    total = x + y
    scaled = total * 3
    if scaled < 0:
        scaled = -scaled
    return scaled


def _hidden_{name}(x):
    """A private helper that no prompt should mention, however long its docstring is."""
    return x


class Box_{name}:
    def open_{name}(self, key, force=False):
        """Open the box with a key unless it is already open, and report what happened."""
        if force:
            return "forced"
        state = key * 2
        return state if state else None
'''


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lib")
    for name in ("alpha", "beta", "gamma", "delta"):
        (root / f"{name}.py").write_text(MODULE.format(name=name))
    (root / "pkg").mkdir()
    (root / "pkg" / "__init__.py").write_text(MODULE.format(name="pkg"))
    for skipped in ("test_omega.py", "_private.py", "idlelib/shell.py", "tests/helper.py"):
        (root / skipped).parent.mkdir(exist_ok=True)
        (root / skipped).write_text(MODULE.format(name=Path(skipped).stem))
    (root / "broken.py").write_text("def (:\n")  # unparsable files are passed over
    return root


def test_the_corpus_reads_public_documented_definitions_without_running_them(library) -> None:
    corpus = load_corpus(library)
    assert [m.name for m in corpus.modules] == ["alpha", "beta", "delta", "gamma", "pkg"]
    names = {f.name for f in corpus.functions}
    assert "alpha.public_alpha" in names and "pkg.Box_pkg.open_pkg" in names
    assert not any(
        "hidden" in n or "omega" in n or "private" in n or "shell" in n or "helper" in n
        for n in names
    )
    method = next(f for f in corpus.functions if f.name == "beta.Box_beta.open_beta")
    assert method.signature == "open_beta(key, force=False)"  # no self
    assert method.source.startswith("def open_beta(self")  # dedented
    assert {f.name for f in corpus.coded} == names  # 5-40 lines each
    assert len(corpus.fingerprint) == 16 and corpus.fingerprint == load_corpus(library).fingerprint


def test_prompt_i_depends_only_on_the_seed_and_i(library) -> None:
    corpus = load_corpus(library)
    ten = task_prompts(corpus, 10, seed=3)
    assert task_prompts(corpus, 4, seed=3, first=6) == ten[6:]  # extending keeps the old ones
    assert task_prompt(corpus, 7, seed=3) == ten[7]
    assert task_prompts(corpus, 10, seed=4) != ten
    assert all(p.strip() for p in ten)


def test_every_task_kind_makes_sound_prompts(library) -> None:
    corpus = load_corpus(library)
    prompts = task_prompts(corpus, 40 * len(TASKS))
    kinds = list(TASKS)
    for i, prompt in enumerate(prompts):
        kind = kinds[i % len(kinds)]
        assert len(prompt) < CONTEXT_CHARS + 400, kind
        assert "hidden" not in prompt, kind
        if kind == "read_code":
            assert "```python\ndef " in prompt
            assert '"""' not in prompt  # the docstring is not given away
        if kind == "passages":
            assert "[1] " in prompt and "Question: " in prompt
        if kind == "translate":
            assert prompt.startswith("Translate the following text into ")
    assert len(set(prompts)) > 0.8 * len(prompts)  # varied


def test_a_folder_without_documented_python_is_refused(tmp_path) -> None:
    (tmp_path / "one.py").write_text(textwrap.dedent('"""Too short."""\n'))
    with pytest.raises(ConfigError, match="give --prompts FILE instead"):
        load_corpus(tmp_path)


def test_data_settings_validate_and_keep_older_data_sets_matching() -> None:
    with pytest.raises(ConfigError, match="not both"):
        DataConfig(prompts=("hi",), tasks=True)
    with pytest.raises(ConfigError, match="context_tokens must be an integer >= 1"):
        DataConfig(context_tokens=0)
    older = {
        "samples": None,
        "answer_tokens": 256,
        "user_tokens": 96,
        "top_k": 20,
        "seed": 0,
        "feature_layers": (),
        "prompts": None,
    }
    assert DataConfig().settings() == older  # a folder made before these settings still matches
    both = DataConfig(tasks=True, context_tokens=64).settings()
    assert both == {**older, "tasks": True, "context_tokens": 64}
