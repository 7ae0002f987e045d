"""A GGUF's header kept in the cache folder (`loading.gguf_index`) and the checks that run
before a model loads (`engine.preflight`).

A tiny random-weight Llama GGUF with a byte-level tokenizer is written here with gguf-py. The
cached index must give what a fresh parse by gguf-py gives (metadata, config, tensor views,
converted tensors; a second `load_model` tokenizes and computes the same without parsing the
file again); a changed file gets a new entry; a damaged entry is ignored, never fatal, and
written again. Argument errors that the model's facts show are raised with the loader, a spy
handed in, never called.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from argparse import Namespace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import save_file
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers

from specfork.cli.generate import _check_chat
from specfork.config import ModelConfig, SpecConfig
from specfork.engine.preflight import open_model
from specfork.errors import ConfigError, SpecforkError
from specfork.heads.model import HeadConfig
from specfork.loading import gguf as gguf_loader
from specfork.loading.facts import model_facts
from specfork.loading.gguf_index import (
    SMALL_ARRAY,
    GGUFIndex,
    index_file,
    load_index,
    open_gguf,
    read_index,
)
from specfork.loading.loader import load_model

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 64, 128, 4, 2, 2
HEAD_DIM = HIDDEN // HEADS
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
TEXTS = [
    "hello world, this is a tiny model",
    "def square(x):\n    return x * x\n",
    "Tabs\tand  double  spaces; (parentheses) {braces} 0123456789",
    "ünïcödé, 日本語 and emoji 🙂 go through the byte fallback",
    "",
]


def _backend() -> Backend:
    """A byte-level BPE trained on a few lines."""
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(TEXTS * 4, trainer)
    return backend


def write_model(path: Path, *, name: str = "tiny", chat: bool = True, vocab_extra: int = 0) -> None:
    """A tiny Llama GGUF: Q8_0 matrices, F32 norms, a byte-level tokenizer (`vocab_extra`
    more tokens than it trains), a chat template when `chat`."""
    data = json.loads(_backend().to_str())["model"]
    vocab = data["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__) + [f"<extra{i}>" for i in range(vocab_extra)]
    w = gguf.GGUFWriter(path, "llama")
    w.add_name(name)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in ("<s>", "</s>") else 1 for t in tokens])
    w.add_token_merges([" ".join(m) for m in data["merges"]])
    w.add_bos_token_id(vocab["<s>"])
    w.add_eos_token_id(vocab["</s>"])
    if chat:
        w.add_chat_template(TEMPLATE)
    rng = np.random.default_rng(len(name))
    shapes = {"token_embd.weight": (len(tokens), HIDDEN), "output_norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (HIDDEN,),
            f"blk.{i}.attn_q.weight": (HIDDEN, HIDDEN),
            f"blk.{i}.attn_k.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_v.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_output.weight": (HIDDEN, HIDDEN),
            f"blk.{i}.ffn_norm.weight": (HIDDEN,),
            f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_up.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_down.weight": (HIDDEN, FFN),
        }
    for tensor, shape in shapes.items():
        values = rng.normal(0.0, 0.1, shape).astype(np.float32)
        if len(shape) == 1:
            w.add_tensor(tensor, values + 1.0)
        else:
            w.add_tensor(tensor, gguf.quants.quantize(values, Q.Q8_0), raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_model(path)
    return path


@pytest.fixture
def cached(model_file: Path, tmp_path: Path) -> Path:
    """A copy of the tiny model of its own (tests below change it)."""
    path = tmp_path / "model" / "tiny.gguf"
    path.parent.mkdir()
    path.write_bytes(model_file.read_bytes())
    return path


# -- the index against a fresh parse ------------------------------------------------------------


def test_the_cached_index_is_what_gguf_py_reads(cached: Path, tmp_path: Path) -> None:
    reader = open_gguf(cached)
    fresh = GGUFIndex.from_reader(reader, cached)
    load_index(cached, tmp_path / "cache")
    stored = read_index(index_file(tmp_path / "cache", cached), cached)
    assert stored is not None
    assert stored.metadata == fresh.metadata and stored.lengths == fresh.lengths
    assert stored.entries == fresh.entries
    assert stored.value("tokenizer.chat_template") == TEMPLATE
    tokens = len(reader.fields["tokenizer.ggml.tokens"].data)
    assert tokens > SMALL_ARRAY and stored.length("tokenizer.ggml.tokens") == tokens
    assert "tokenizer.ggml.tokens" not in stored.metadata  # long arrays by their length only
    assert gguf_loader.config_from_gguf(stored, cached) == gguf_loader.config_from_gguf(
        fresh, cached
    )
    for ours, theirs in zip(stored.tensors, reader.tensors, strict=True):
        assert (ours.name, ours.tensor_type) == (theirs.name, theirs.tensor_type)
        assert ours.shape == tuple(int(d) for d in theirs.shape)
        assert ours.data.dtype == theirs.data.dtype and ours.data.shape == theirs.data.shape
        assert np.array_equal(ours.data, theirs.data)


def test_converted_tensors_are_the_same(cached: Path, tmp_path: Path) -> None:
    fresh = GGUFIndex.from_reader(open_gguf(cached), cached)
    load_index(cached, tmp_path)
    stored = load_index(cached, tmp_path)
    cfg = gguf_loader.config_from_gguf(stored, cached)
    ours = dict(gguf_loader.iter_tensors(stored, cfg, torch.float32))
    theirs = dict(gguf_loader.iter_tensors(fresh, cfg, torch.float32))
    assert ours.keys() == theirs.keys() and len(ours) == 2 + 9 * LAYERS
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_a_second_load_reads_the_caches_and_tokenizes_the_same(
    cached: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("SPECFORK_CACHE_DIR", str(tmp_path / "cache"))
    with caplog.at_level(logging.INFO, logger="specfork.loading.gguf_index"):
        first = load_model(cached, progress=False)
        assert "parsed the GGUF header" in caplog.text
        caplog.clear()
        again = load_model(cached, progress=False)
        assert "parsed the GGUF header" not in caplog.text  # read from the cache folder
    assert again.config == first.config
    for text in TEXTS:
        ids = first.tokenizer.encode(text)
        assert again.tokenizer.encode(text) == ids
        assert again.tokenizer.decode(ids) == first.tokenizer.decode(ids)
    assert again.tokenizer.chat_template == TEMPLATE
    ids = torch.tensor([first.tokenizer.encode(TEXTS[0])])  # [1, T]
    logits = []
    for loaded in (first, again):
        with torch.inference_mode():
            cache = loaded.model.new_cache(64)
            hidden = loaded.model(ids, torch.arange(ids.shape[1]), cache)  # [1, T, D]
            logits.append(loaded.model.logits(hidden[0]))  # [T, V]
    assert torch.equal(logits[0], logits[1])


# -- invalidation and damage --------------------------------------------------------------------


def test_a_changed_file_gets_a_new_entry(cached: Path, tmp_path: Path) -> None:
    before = index_file(tmp_path, cached)
    load_index(cached, tmp_path)
    write_model(cached, name="edited")  # same path, new content
    later = time.time() + 10
    os.utime(cached, (later, later))
    after = index_file(tmp_path, cached)
    assert after != before
    assert load_index(cached, tmp_path).value("general.name") == "edited"
    assert after.exists() and not before.exists()  # the old entry is removed


def _garbage(path: Path) -> None:
    path.write_bytes(b"\x10\x00\x00\x00not a safetensors file")


def _truncated(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _bad_json(path: Path) -> None:
    save_file({}, path, metadata={"index": "{not json", "source": "x"})


def _past_the_end(path: Path) -> None:
    meta = json.loads(_metadata(path)["index"])
    meta["tensors"][0][3] = 10**12  # an offset beyond the file
    save_file({}, path, metadata={"index": json.dumps(meta), "source": "x"})


def _missing_key(path: Path) -> None:
    save_file({}, path, metadata={"source": "x"})


def _metadata(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return f.metadata()


@pytest.mark.parametrize("damage", [_garbage, _truncated, _bad_json, _past_the_end, _missing_key])
def test_a_damaged_entry_is_ignored_and_written_again(
    cached: Path, tmp_path: Path, damage: Any, caplog: pytest.LogCaptureFixture
) -> None:
    reference = load_index(cached, tmp_path)
    entry = index_file(tmp_path, cached)
    damage(entry)
    with caplog.at_level(logging.WARNING, logger="specfork.loading.gguf_index"):
        index = load_index(cached, tmp_path)
    assert "ignoring the unreadable GGUF index" in caplog.text
    assert index.entries == reference.entries and index.metadata == reference.metadata
    rewritten = read_index(entry, cached)
    assert rewritten is not None and rewritten.entries == reference.entries


# -- checks before loading ----------------------------------------------------------------------


class SpyLoader:
    """A loader that records its calls and loads nothing."""

    def __init__(self) -> None:
        self.calls: list[tuple[Path, dict[str, Any]]] = []

    def __call__(self, path: Path, **options: Any) -> str:
        self.calls.append((path, options))
        return "loaded"


def _head_for(cfg: ModelConfig, folder: Path) -> Path:
    """A head folder whose head.json was made for `cfg` (its weights are never read here)."""
    folder.mkdir(parents=True)
    head = HeadConfig.for_target(cfg, draft_vocab=32)
    (folder / "head.json").write_text(json.dumps(head.to_dict()))
    (folder / "head.safetensors").write_bytes(b"")
    return folder


def test_a_good_run_loads_once(cached: Path, tmp_path: Path) -> None:
    spy = SpyLoader()
    spec = SpecConfig(strategy="speculative", drafter="ngram+self", self_layers="0")
    assert open_model(str(cached), spec, load=spy, progress=False, dtype="auto") == "loaded"
    assert spy.calls == [(cached, {"progress": False, "dtype": "auto"})]


def test_no_shipped_head_is_an_error_before_loading(cached: Path) -> None:
    spy = SpyLoader()
    with pytest.raises(ConfigError, match=r"no draft head ships for tiny\.gguf"):
        open_model(str(cached), SpecConfig(strategy="speculative", drafter="head"), load=spy)
    assert spy.calls == []


def test_a_head_for_another_model_is_an_error_before_loading(cached: Path, tmp_path: Path) -> None:
    other = model_facts(cached).config
    other = ModelConfig.from_dict({**other.to_dict(), "num_layers": 4})
    folder = _head_for(other, tmp_path / "head")
    spy = SpyLoader()
    spec = SpecConfig(strategy="speculative", drafter=f"head:{folder}")
    with pytest.raises(ConfigError, match="was trained for a"):
        open_model(str(cached), spec, load=spy)
    assert spy.calls == []
    missing = SpecConfig(strategy="speculative", drafter=f"head:{tmp_path / 'nowhere'}")
    with pytest.raises(ConfigError, match="is not a draft head"):
        open_model(str(cached), missing, load=spy)
    assert spy.calls == []


def test_a_draft_model_of_another_vocabulary_is_an_error_before_loading(
    cached: Path, tmp_path: Path
) -> None:
    draft = tmp_path / "draft.gguf"
    write_model(draft, name="draft", vocab_extra=16)
    spy = SpyLoader()
    spec = SpecConfig(strategy="speculative", drafter=f"model:{draft}")
    with pytest.raises(ConfigError, match=r"vocabulary .* differs from the target's"):
        open_model(str(cached), spec, load=spy)
    missing = SpecConfig(strategy="speculative", drafter=f"model:{tmp_path / 'none.gguf'}")
    with pytest.raises(SpecforkError, match="no such file"):
        open_model(str(cached), missing, load=spy)
    assert spy.calls == []


def test_self_layers_the_model_lacks_are_an_error_before_loading(cached: Path) -> None:
    spy = SpyLoader()
    spec = SpecConfig(strategy="speculative", drafter="self", self_layers="0-9")
    with pytest.raises(ConfigError, match="out of range; this model has layers 0-1"):
        open_model(str(cached), spec, load=spy)
    assert spy.calls == []


@pytest.mark.parametrize(
    ("chat", "system", "message"),
    [
        (True, None, "has no chat template .a base model continues text.; drop --chat"),
        (None, "Be brief.", "--system needs chat mode"),
    ],
)
def test_chat_without_a_template_is_an_error_before_loading(
    cached: Path, tmp_path: Path, chat: bool | None, system: str | None, message: str
) -> None:
    plain = tmp_path / "plain.gguf"
    write_model(plain, chat=False)
    check = functools.partial(_check_chat, Namespace(chat=chat, system=system, batch=None))
    spy = SpyLoader()
    with pytest.raises(SpecforkError, match=message):
        open_model(str(plain), check=check, load=spy)
    assert spy.calls == []
    assert open_model(str(cached), check=check, load=spy) == "loaded"  # it has a template


def test_specfork_cache_knows_the_entries(cached: Path, tmp_path: Path) -> None:
    """`specfork cache` keeps a current index and prunes one of a changed file."""
    from specfork.loading.cache_folder import entries

    folder = tmp_path / "cache"
    load_index(cached, folder / "weights")
    (entry,) = entries(folder, None)
    assert entry.part == "weights" and "-index-" in entry.path.name and entry.stale == ""
    later = time.time() + 10
    os.utime(cached, (later, later))
    (entry,) = entries(folder, None)
    assert "changed since" in entry.stale
