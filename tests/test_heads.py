"""Trained draft heads: data the target makes, training with training-time test, the head
drafter in every strategy (lossless), and refusals of foreign or broken heads.

Heads here are trained for a few steps only: they test the machinery, not the head's quality
(that is measured by `specfork bench`, docs/benchmarks.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specfork.config import GenerationConfig, SamplingParams, SpecConfig
from specfork.drafters.base import DraftShape, Feedback
from specfork.drafters.head import HeadDrafter
from specfork.engine import Generator
from specfork.errors import ConfigError
from specfork.heads.model import load_head
from specfork.loading.loader import LoadedModel
from specfork.sampling import make_generator
from specfork.tools.head_data import DataConfig, load_data, make_data
from specfork.tools.head_train import TrainConfig, train_head

pytestmark = pytest.mark.slow  # the real packaged model

TRAIN = TrainConfig(
    steps=8, window=48, windows=1, draft_vocab=1024, checkpoint_every=4, holdout=0.34
)
PROMPT = "Count: 1, 2, 3, 4, 5,"


@pytest.fixture(scope="module")
def data(smollm_f32: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("head") / "data"
    return make_data(smollm_f32, folder, DataConfig(samples=3, answer_tokens=32, user_tokens=16))


@pytest.fixture(scope="module")
def head_dir(smollm_f32: LoadedModel, data: Path) -> Path:
    meta, samples = load_data(data)
    out = data.parent / "head"
    train_head(smollm_f32, samples, tuple(meta["feature_layers"]), out, TRAIN)
    return out


def test_the_data_holds_features_and_the_targets_top_k(smollm_f32, data: Path) -> None:
    meta, samples = load_data(data)
    d = smollm_f32.model.config.hidden_size
    assert meta["feature_layers"] == [2, 15, 27] and len(samples) == 3
    for s in samples:
        t = len(s["tokens"])
        assert s["features"].shape == (t, 3 * d) and s["features"].dtype == torch.float16
        assert s["top_index"].shape == (t, 20) and s["top_logp"].shape == (t, 20)
    # the features are the blocks' outputs of one forward over the conversation
    ids = samples[0]["tokens"].tolist()
    model = smollm_f32.model
    with torch.inference_mode():
        _, ref = model.forward_capturing(
            torch.tensor(ids)[None], torch.arange(len(ids)), model.new_cache(len(ids) + 1),
            capture=(2, 15, 27),
        )  # fmt: skip
    got = samples[0]["features"].float().view(len(ids), 3, d).permute(1, 0, 2)
    torch.testing.assert_close(got, ref, atol=0.02, rtol=0.01)  # float16 storage
    again = make_data(smollm_f32, data, DataConfig(samples=3, answer_tokens=32, user_tokens=16))
    assert load_data(again)[1][0]["tokens"].tolist() == ids  # resumed: nothing made twice
    with pytest.raises(ConfigError, match="made differently"):
        make_data(smollm_f32, data, DataConfig(samples=3, answer_tokens=8, feature_layers=(1,)))


def test_training_lowers_the_loss_and_resumes_where_it_stopped(smollm_f32, data, tmp_path) -> None:
    meta, samples = load_data(data)
    layers = tuple(meta["feature_layers"])
    losses: list[float] = []
    whole = train_head(smollm_f32, samples, layers, tmp_path / "a", TRAIN,
                       lambda s: losses.append(s.loss))  # fmt: skip
    assert losses[-1] < losses[0]
    history = json.loads((tmp_path / "a" / "training.json").read_text())
    assert [h["step"] for h in history] == [4, 8]  # at every checkpoint
    assert all(0.0 <= h["held_out"] <= 1.0 for h in history)  # one of 3 samples held out

    def interrupt(stats) -> None:
        if stats.step == 6:
            raise KeyboardInterrupt  # after the checkpoint of step 4

    with pytest.raises(KeyboardInterrupt):
        train_head(smollm_f32, samples, layers, tmp_path / "b", TRAIN, interrupt)
    resumed = train_head(smollm_f32, samples, layers, tmp_path / "b", TRAIN)
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
    with pytest.raises(ConfigError, match="other settings"):
        other = TrainConfig(steps=8, window=48, windows=2, draft_vocab=1024)
        train_head(smollm_f32, samples, layers, tmp_path / "b", other)


@pytest.mark.parametrize(
    "spec",
    [
        {"strategy": "speculative", "k": 4, "goodput": False},
        {"strategy": "dspark"},
        {"strategy": "spork", "drafter": "head", "tree": "forks"},
        {"strategy": "spork", "drafter": "head", "tree": "dynamic"},
        {"strategy": "spork", "drafter": "recycle+ngram+head"},
    ],
    ids=["chain", "dspark", "spork-forks", "spork-dynamic", "spork-merged"],
)
def test_the_head_drafts_in_every_strategy_losslessly(smollm_f32, head_dir, spec) -> None:
    drafter = spec.pop("drafter", "head").replace("head", f"head:{head_dir}")
    config = GenerationConfig(max_new_tokens=32, ignore_eos=True)
    plain = Generator(smollm_f32).generate(PROMPT, config=config)
    result = Generator(smollm_f32, spec=SpecConfig(drafter=drafter, **spec)).generate(
        PROMPT, config=config
    )
    assert result.token_ids == plain.token_ids
    assert result.stats.drafted > 0


def test_a_sampled_head_draft_carries_its_q(smollm_f32, head_dir) -> None:
    """Sampled drafts come with q over the target's vocabulary: zero outside the draft
    vocabulary, each row a distribution, each token drawn from its row."""
    head = load_head(head_dir, smollm_f32.model.config)
    drafter = HeadDrafter(head, smollm_f32.model)
    ids = Generator(smollm_f32).encode_prompt(PROMPT)
    session = drafter.begin(ids)
    model = smollm_f32.model
    with torch.inference_mode():
        _, hidden = model.extend_capturing(
            ids, model.new_cache(len(ids) + 8), head.config.feature_layers
        )
    session.observe(Feedback(len(ids), torch.tensor(ids), [], None, hidden, prompt=True))
    history = [*ids, 42]
    sampling = SamplingParams(temperature=0.8, seed=1)
    draft = session.propose(history, DraftShape(3), sampling, make_generator(1))
    assert draft.q is not None and draft.q.shape == (3, model.config.vocab_size)
    torch.testing.assert_close(draft.q.sum(-1), torch.ones(3))
    outside = torch.ones(model.config.vocab_size, dtype=torch.bool)
    outside[head.d2t] = False
    assert float(draft.q[:, outside].sum()) == 0.0
    assert all(draft.q[i, t] > 0 for i, t in enumerate(draft.tokens.tolist()))


def test_foreign_corrupt_and_missing_heads_are_refused(smollm_f32, head_dir, tmp_path) -> None:
    cfg = smollm_f32.model.config
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    meta = json.loads((head_dir / "head.json").read_text())
    (foreign / "head.json").write_text(json.dumps({**meta, "hidden_size": 960}))
    (foreign / "head.safetensors").write_bytes((head_dir / "head.safetensors").read_bytes())
    with pytest.raises(ConfigError, match=r"hidden size 960.*hidden size 576"):
        load_head(foreign, cfg)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "head.json").write_text((head_dir / "head.json").read_text())
    data = (head_dir / "head.safetensors").read_bytes()
    (broken / "head.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match="corrupt or incomplete"):
        load_head(broken, cfg)
    with pytest.raises(ConfigError, match="not a draft head"):
        load_head(tmp_path, cfg)
    with pytest.raises(ConfigError, match="no draft head ships"):
        Generator(smollm_f32, spec=SpecConfig("speculative", "head"))
