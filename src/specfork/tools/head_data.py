"""Training data for a draft head, made by the target itself.

Each sample is a conversation the target writes: a user turn it samples from its own chat
template's user prefix (Magpie-style: the template up to where a user's text would start), a
prompt from a file the user gives, or a task prompt (`task_prompts`), then its own answer
(greedy for even samples, sampled at temperature 0.7 for odd ones, so the head sees both).
One forward over the whole conversation records, per token, what training needs and nothing
more (from `context_tokens` tokens before the answer on, when set):

- the outputs of the target's feature blocks, concatenated [T, C·D], float16 (a few KB a token);
- the target's `top_k` log-probabilities at every position (indices int32, values float16): the
  distribution the head learns, without storing full-vocabulary logits.

Samples go to shards of `SHARD` samples (`shard-00000.safetensors`, written atomically), so an
interrupted run resumes at the first missing shard with the same seed: the same data.
`load_data` keeps the shards memory-mapped and reads a sample's rows when training asks for
them (`StoredSample`): data sets of many GB train without being copied into memory.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specfork.checks import is_int
from specfork.config import GenerationConfig, SamplingParams
from specfork.errors import ConfigError
from specfork.loading.loader import LoadedModel
from specfork.tools.task_prompts import Corpus, load_corpus, task_prompts

if TYPE_CHECKING:
    from specfork.engine.generator import Generator

log = logging.getLogger(__name__)

SHARD = 16  # samples per shard file
SAMPLE_KEYS = ("tokens", "features", "top_index", "top_logp")  # what a sample stores
USER_MARK = "\u2063specfork-user\u2063"  # a string no template contains, cut out of the render


@dataclass(frozen=True, slots=True)
class DataConfig:
    """How much data to make and how."""

    samples: int = 256
    answer_tokens: int = 256
    user_tokens: int = 96  # most tokens of a self-written user turn
    top_k: int = 20
    seed: int = 0
    feature_layers: tuple[int, ...] = ()  # () = the head's default (2, L/2, L-3)
    prompts: tuple[str, ...] = ()  # user turns to use instead of self-written ones (cycled)
    tasks: bool = False  # user turns from task templates over the standard library's docs
    context_tokens: int | None = None  # most tokens kept before each answer (None: all)

    def __post_init__(self) -> None:
        for name in ("samples", "answer_tokens", "user_tokens", "top_k"):
            _check_count(name, getattr(self, name))
        if self.context_tokens is not None:
            _check_count("context_tokens", self.context_tokens)
        object.__setattr__(self, "feature_layers", tuple(self.feature_layers))
        object.__setattr__(self, "prompts", tuple(self.prompts))
        if self.tasks and self.prompts:
            raise ConfigError("give a prompt file or task prompts, not both")

    def settings(self) -> dict:
        """What makes one sample differ from another (the meta's record; settings left at
        their defaults since they were added are left out, so older data sets still match)."""
        out = {**asdict(self), "samples": None, "prompts": None}
        defaults = {f.name: f.default for f in fields(self)}
        for name in ("tasks", "context_tokens"):
            if out[name] == defaults[name]:
                del out[name]
        return out


def _check_count(name: str, value: object) -> None:
    if not is_int(value) or value < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")


def make_data(
    loaded: LoadedModel,
    folder: Path,
    cfg: DataConfig,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write (or complete) the data set in `folder`; returns it. `progress(done, total)`."""
    from specfork.engine.generator import Generator
    from specfork.heads.model import default_feature_layers

    model_cfg = loaded.model.config
    layers = cfg.feature_layers or default_feature_layers(model_cfg.num_layers)
    if any(not 0 <= i < model_cfg.num_layers for i in layers):
        last = model_cfg.num_layers - 1
        raise ConfigError(f"feature layers {layers} outside the target's blocks 0-{last}")
    folder.mkdir(parents=True, exist_ok=True)
    corpus = load_corpus() if cfg.tasks else None
    _check_meta(folder, loaded, cfg, layers, corpus)
    gen = Generator(loaded)
    shards = -(-cfg.samples // SHARD)
    for shard in range(shards):
        path = folder / f"shard-{shard:05d}.safetensors"
        first, last = shard * SHARD, min(cfg.samples, (shard + 1) * SHARD)
        if _shard_samples(path) != last - first:  # missing, or made for fewer samples
            records = _samples(gen, loaded, cfg, layers, range(first, last), corpus)
            _write_shard(path, records)
        if progress is not None:
            progress(last, cfg.samples)
    return folder


def _check_meta(
    folder: Path,
    loaded: LoadedModel,
    cfg: DataConfig,
    layers: tuple[int, ...],
    corpus: Corpus | None = None,
) -> None:
    """Record what the data is; refuse to mix it with data made otherwise."""
    from specfork.atomic import write_text

    settings = {**cfg.settings(), "feature_layers": list(layers)}
    if corpus is not None:  # task prompts: the library text they are made from
        settings["tasks_corpus"] = corpus.fingerprint
    prompts = hashlib.sha256("\0".join(cfg.prompts).encode()).hexdigest() if cfg.prompts else None
    meta = {
        "target": loaded.path.name,
        "hidden_size": loaded.model.config.hidden_size,
        "vocab_size": loaded.model.config.vocab_size,
        "feature_layers": list(layers),
        "config": {**settings, "prompts_sha256": prompts},
    }
    meta = json.loads(json.dumps(meta))  # as it reads back
    path = folder / "meta.json"
    if path.exists():
        old = json.loads(path.read_text())
        if old != meta:
            was, now = old.get("config", {}), meta["config"]
            differ = sorted(k for k in {*was, *now} if was.get(k) != now.get(k))
            hint = " (task prompts from another Python version)" if "tasks_corpus" in differ else ""
            raise ConfigError(
                f"{folder} holds head data made differently ({old['target']}, layers "
                f"{old['feature_layers']}; other {', '.join(differ) or 'target'}{hint}); use "
                "another folder or the same settings"
            )
        return
    write_text(path, json.dumps(meta, indent=1))


def _samples(
    gen: Generator,
    loaded: LoadedModel,
    cfg: DataConfig,
    layers: tuple[int, ...],
    index: range,
    corpus: Corpus | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Samples `index`: user turns, the target's answers (generated together in one batch:
    each request keeps its own seed and the target's rows are batch-invariant, so they are the
    answers it gives alone), then each conversation's features and top-k (from at most
    `context_tokens` tokens before the answer on)."""
    from specfork.engine.batch import BatchConfig, generate_batch

    if cfg.prompts:
        users = [cfg.prompts[i % len(cfg.prompts)] for i in index]
    elif cfg.tasks:
        if corpus is None:
            raise ValueError("task prompts need the corpus they are made from")
        users = task_prompts(corpus, len(index), cfg.seed, first=index.start)
    else:
        users = _user_turns(gen, loaded, cfg, index)
    chats = [[{"role": "user", "content": user}] for user in users]
    sampling = [  # greedy for even samples, sampled for odd ones
        SamplingParams() if i % 2 == 0 else SamplingParams(temperature=0.7, seed=cfg.seed + i)
        for i in index
    ]
    config = GenerationConfig(max_new_tokens=cfg.answer_tokens)
    batch = BatchConfig(max_running=len(index))
    results = generate_batch(gen, chats, config=config, sampling=sampling, batch=batch)
    keep = cfg.context_tokens
    return [
        record(
            loaded,
            r.prompt_ids + r.token_ids,
            layers,
            cfg.top_k,
            0 if keep is None else max(0, len(r.prompt_ids) - keep),
        )
        for r in results
    ]


def _user_turns(gen: Generator, loaded: LoadedModel, cfg: DataConfig, index: range) -> list[str]:
    """User messages the target writes after its template's user prefix (Magpie)."""
    from specfork.engine.batch import BatchConfig, generate_batch

    tok = loaded.tokenizer
    if tok.chat_template is None:
        raise ConfigError("self-written prompts need a chat template; give a prompt file")
    text = tok.apply_chat_template([{"role": "user", "content": USER_MARK}])
    prefix = text[: text.index(USER_MARK)] if USER_MARK in text else text
    ids = tok.encode(prefix)
    sampling = [
        SamplingParams(temperature=1.0, top_p=0.95, seed=cfg.seed * 1_000_003 + i) for i in index
    ]
    config = GenerationConfig(max_new_tokens=cfg.user_tokens)
    batch = BatchConfig(max_running=len(index))
    results = generate_batch(gen, [ids] * len(index), config=config, sampling=sampling, batch=batch)
    return [r.text.strip() or "Hello!" for r in results]


def record(
    loaded: LoadedModel, ids: list[int], layers: tuple[int, ...], top_k: int, first: int = 0
) -> dict[str, torch.Tensor]:
    """One forward over `ids`: tokens, features [T, C·D] fp16, top-k [T, k] of the target,
    kept from position `first` on (the forward still reads all of `ids`)."""
    model = loaded.model
    with torch.inference_mode():
        cache = model.new_cache(len(ids) + 1)
        tokens = torch.tensor(ids)  # [T]
        hidden, captured = model.forward_capturing(
            tokens[None], torch.arange(len(ids)), cache, capture=layers
        )  # [1, T, D], [C, T, D]
        logp = torch.log_softmax(model.logits(hidden[0]), dim=-1)  # [T, V]
        top = logp.topk(top_k, dim=-1)
    assert captured is not None
    feats = captured.permute(1, 0, 2).flatten(1)  # [T, C·D]
    return {
        "tokens": tokens[first:].int(),
        "features": feats[first:].half(),
        "top_index": top.indices[first:].int(),
        "top_logp": top.values[first:].half(),
    }


def _shard_samples(path: Path) -> int:
    """Samples in a written shard (0 if there is none or it cannot be read)."""
    from safetensors import SafetensorError, safe_open

    if not path.exists():
        return 0
    try:
        with safe_open(str(path), "pt") as f:
            return f.get_slice("offsets").get_shape()[0] - 1
    except (SafetensorError, OSError):
        return 0


def _write_shard(path: Path, records: list[dict[str, torch.Tensor]]) -> None:
    from safetensors.torch import save_file

    lengths = torch.tensor([len(r["tokens"]) for r in records])
    tensors = {k: torch.cat([r[k] for r in records]).contiguous() for k in records[0]}
    tensors["offsets"] = torch.cat((torch.zeros(1, dtype=torch.long), lengths.cumsum(0)))
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp))
    tmp.replace(path)


class StoredSample(Mapping[str, torch.Tensor]):
    """One stored conversation, read from its shard when asked: the shard stays memory-mapped
    (safetensors), so a data set larger than memory trains without being copied onto the heap;
    only the tokens are kept in memory. `sample[key]` is that tensor's rows of this sample."""

    __slots__ = ("_end", "_shard", "_start", "_tokens")

    def __init__(self, shard: Any, start: int, end: int) -> None:
        self._shard, self._start, self._end = shard, start, end
        self._tokens = shard.get_slice("tokens")[start:end]  # [T] int32

    def __getitem__(self, key: str) -> torch.Tensor:
        if key == "tokens":
            return self._tokens
        if key not in SAMPLE_KEYS:
            raise KeyError(key)
        return self._shard.get_slice(key)[self._start : self._end]

    def __iter__(self) -> Iterator[str]:
        return iter(SAMPLE_KEYS)

    def __len__(self) -> int:
        return len(SAMPLE_KEYS)

    def rows(self, start: int, end: int) -> dict[str, torch.Tensor]:
        """Rows [start, end) of every tensor (only those rows are read)."""
        a, b = self._start + max(0, start), self._start + min(end, self._end - self._start)
        return {k: self._shard.get_slice(k)[a:b] for k in SAMPLE_KEYS}


def sample_rows(
    sample: Mapping[str, torch.Tensor], start: int, end: int
) -> dict[str, torch.Tensor]:
    """Rows [start, end) of every tensor of a sample (a stored one reads only those rows)."""
    if isinstance(sample, StoredSample):
        return sample.rows(start, end)
    return {k: v[start:end] for k, v in sample.items()}


def load_data(folder: Path) -> tuple[dict, list[StoredSample]]:
    """The data set's meta and its samples (each: tokens, features, top_index, top_logp), read
    from the memory-mapped shards on demand."""
    from safetensors import SafetensorError, safe_open

    meta_path = folder / "meta.json"
    if not meta_path.is_file():
        raise ConfigError(f"{folder} holds no head data (meta.json); make it with train-head")
    meta = json.loads(meta_path.read_text())
    samples = []
    for path in sorted(folder.glob("shard-*.safetensors")):
        try:
            shard = safe_open(str(path), "pt")
            off = _checked_offsets(shard)
            samples += [StoredSample(shard, a, b) for a, b in itertools.pairwise(off)]
        except (SafetensorError, OSError, ValueError) as exc:
            raise ConfigError(
                f"the data shard {path} is corrupt ({exc}); delete it and resume"
            ) from exc
    if not samples:
        raise ConfigError(f"{folder} holds no samples yet")
    return meta, samples


def _checked_offsets(shard: Any) -> list[int]:
    """The shard's sample offsets; ValueError unless it holds every key with one row per
    token."""
    stored = set(shard.keys())
    missing = [k for k in (*SAMPLE_KEYS, "offsets") if k not in stored]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    off = shard.get_tensor("offsets").tolist()
    rows = {k: shard.get_slice(k).get_shape()[0] for k in SAMPLE_KEYS}
    if any(n != off[-1] for n in rows.values()):
        raise ValueError(f"rows {rows} do not match the offsets' {off[-1]} tokens")
    return off
