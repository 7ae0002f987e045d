"""Trained draft heads: data the target makes, training with training-time test, the head
drafter in every strategy (lossless), and refusals of foreign or broken heads.

Heads here are trained for a few steps only: they test the machinery, not the head's quality
(that is measured by `specfork bench`, docs/benchmarks.md)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from cli_run import run_cli
from head_session import head_session
from specfork.config import GenerationConfig, SamplingParams, SpecConfig
from specfork.drafters.base import Draft, DraftShape, StepConfidence
from specfork.drafters.head import HeadDrafter
from specfork.drafters.meter import CostMeter
from specfork.engine.generator import Generator
from specfork.errors import ConfigError
from specfork.heads.fast import KernelHead, on_kernels
from specfork.heads.model import load_head, save_head
from specfork.heads.packaged import packaged_head
from specfork.loading.loader import LoadedModel
from specfork.sampling import make_generator
from specfork.tools.head_data import DataConfig, load_data, make_data
from specfork.tools.head_train import TrainConfig, chain_runs, train_head

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
            torch.tensor(ids)[None],
            torch.arange(len(ids)),
            model.new_cache(len(ids) + 1),
            capture=(2, 15, 27),
        )
    got = samples[0]["features"].float().view(len(ids), 3, d).permute(1, 0, 2)
    torch.testing.assert_close(got, ref, atol=0.02, rtol=0.01)  # float16 storage
    again = make_data(smollm_f32, data, DataConfig(samples=3, answer_tokens=32, user_tokens=16))
    assert load_data(again)[1][0]["tokens"].tolist() == ids  # resumed: nothing made twice
    with pytest.raises(ConfigError, match=r"made differently.*other answer_tokens, feature_lay"):
        make_data(smollm_f32, data, DataConfig(samples=3, answer_tokens=8, feature_layers=(1,)))


def test_training_lowers_the_loss_and_resumes_where_it_stopped(smollm_f32, data, tmp_path) -> None:
    meta, samples = load_data(data)
    layers = tuple(meta["feature_layers"])
    losses: list[float] = []
    whole = train_head(
        smollm_f32, samples, layers, tmp_path / "a", TRAIN, lambda s: losses.append(s.loss)
    )
    assert losses[-1] < losses[0]
    history = json.loads((tmp_path / "a" / "training.json").read_text())
    assert [h["step"] for h in history] == [4, 8]  # at every checkpoint
    assert all(0.0 <= h["held_out"] <= 1.0 for h in history)  # one of 3 samples held out
    assert all(1.0 <= h["held_out_chain"] <= 1 + TRAIN.unroll for h in history)
    best = max(history, key=lambda h: h["held_out_chain"])  # the head saved is that step's
    saved = torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=False)["best"]
    assert saved["step"] == best["step"]
    for name, value in whole.state_dict().items():
        assert torch.equal(value, saved["head"][name]), name

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
    with pytest.raises(ConfigError, match="precision must be one of"):
        TrainConfig(precision="float8")
    float32 = TrainConfig(**{**dataclasses.asdict(TRAIN), "precision": "float32"})
    assert TRAIN.bf16 == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()) and not float32.bf16


def test_training_can_start_from_another_head(smollm_f32, data, head_dir, tmp_path) -> None:
    """`--init`: a new run starts from a head's weights and draft vocabulary (fine-tuning it
    on other data); a head reading other blocks than the data holds is refused."""
    meta, samples = load_data(data)
    layers = tuple(meta["feature_layers"])
    start = load_head(head_dir, smollm_f32.model.config)
    still = TrainConfig(**{**dataclasses.asdict(TRAIN), "steps": 1, "lr": 1e-9, "draft_vocab": 64})
    tuned = train_head(smollm_f32, samples, layers, tmp_path / "tuned", still, init=start)
    assert torch.equal(tuned.d2t, start.d2t)  # the start's vocabulary, not 64 tokens of this data
    for name, value in start.state_dict().items():  # one step of lr 1e-9: the start's weights
        torch.testing.assert_close(tuned.state_dict()[name], value, atol=1e-6, rtol=0, msg=name)
    with pytest.raises(ConfigError, match="make the data with --layers 2,15,27"):
        train_head(smollm_f32, samples, (2, 15), tmp_path / "other", still, init=start)


def test_the_train_head_command_makes_data_trains_and_reports(tmp_path, capsys) -> None:
    """`specfork train-head` end to end: data, training, the held-out figures of the head it
    saved, and a head that loads for the drafter."""
    out = tmp_path / "cli-head"
    code, _, err = run_cli(
        capsys,
        [
            "train-head",
            "--dtype",
            "float32",
            "--out",
            str(out),
            "--samples",
            "3",
            "--answer-tokens",
            "8",
            "--steps",
            "3",
            "--window",
            "16",
            "--windows",
            "1",
            "--unroll",
            "2",
            "--draft-vocab",
            "512",
            "--holdout",
            "0.4",
        ],
    )
    assert code == 0, err
    text = " ".join(err.split())
    assert re.search(
        r"held-out answers: top-1 agreement [\d.]+, [\d.]+ tokens per forward in "
        r"a chain of 2 \(saved: step 3\)",
        text,
    ), text
    history = json.loads((out / "training.json").read_text())
    assert [h["step"] for h in history] == [3] and 1.0 <= history[0]["held_out_chain"] <= 3.0
    assert (out / "head.safetensors").exists() and (out / "data" / "meta.json").exists()
    code, _, err = run_cli(
        capsys,
        [
            "train-head",
            "--dtype",
            "float32",
            "--out",
            str(out),
            "--samples",
            "3",
            "--answer-tokens",
            "8",
            "--steps",
            "7",
            "--window",
            "16",
            "--windows",
            "1",
            "--unroll",
            "2",
            "--draft-vocab",
            "512",
            "--holdout",
            "0.4",
            "--checkpoint-every",
            "2",
        ],
    )
    assert code == 0, err  # extended, measured at other intervals: resumed, not refused
    history = json.loads((out / "training.json").read_text())
    assert [h["step"] for h in history] == [3, 4, 6, 7]


def test_data_only_makes_the_data_and_stops(tmp_path, capsys) -> None:
    """`--data-only`: the data set is written (and completed when asked for more), no head."""
    out = tmp_path / "data-only"
    args = [
        "train-head",
        "--dtype",
        "float32",
        "--out",
        str(out),
        "--answer-tokens",
        "4",
        "--data-only",
    ]
    code, _, err = run_cli(capsys, [*args, "--samples", "1"])
    assert code == 0, err
    assert "train on it with --data" in " ".join(err.split())
    assert len(load_data(out / "data")[1]) == 1 and not (out / "head.safetensors").exists()
    code, _, err = run_cli(capsys, [*args, "--samples", "2"])
    assert code == 0, err
    assert len(load_data(out / "data")[1]) == 2 and not (out / "checkpoint.pt").exists()


def test_task_data_keeps_the_answers_and_trains_beside_other_sets(tmp_path, data, capsys) -> None:
    """`--tasks --context-tokens N`: user turns from the task templates, samples cut to N
    tokens before the answer; `--extra-data` trains on an earlier set too (each set holds out
    its own share), and a set made for other layers is refused."""
    out = tmp_path / "tasks-head"
    args = [
        "train-head",
        "--dtype",
        "float32",
        "--out",
        str(out),
        "--samples",
        "2",
        "--answer-tokens",
        "8",
        "--tasks",
        "--context-tokens",
        "6",
        "--steps",
        "2",
        "--window",
        "12",
        "--windows",
        "1",
        "--unroll",
        "2",
        "--draft-vocab",
        "512",
        "--holdout",
        "0.4",
    ]
    code, _, err = run_cli(capsys, [*args, "--extra-data", str(data)])
    assert code == 0, err
    assert "data 5 samples" in " ".join(err.split())  # 2 made here + 3 from the earlier set
    meta, samples = load_data(out / "data")
    assert meta["config"]["tasks"] is True and meta["config"]["context_tokens"] == 6
    assert len(meta["config"]["tasks_corpus"]) == 16
    for s in samples:  # 6 prompt tokens, then the answer (at most 8 tokens and an end)
        assert 7 <= len(s["tokens"]) <= 6 + 9 and s["features"].shape[0] == len(s["tokens"])
    foreign = tmp_path / "foreign"
    code, _, err = run_cli(
        capsys,
        [
            "train-head",
            "--dtype",
            "float32",
            "--out",
            str(foreign),
            "--samples",
            "1",
            "--answer-tokens",
            "4",
            "--layers",
            "1,2",
            "--steps",
            "1",
            "--extra-data",
            str(data),
        ],
    )
    assert code != 0 and "train on data sets of one target and feature layers" in err


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--layers", "2,15,99"], "outside the target's blocks 0-29"),
        (["--init", "/nonexistent-head"], "is not a draft head"),
        (["--data", "{tmp}/a-file"], "is a file; give a folder"),
    ],
)
def test_a_refused_training_run_leaves_no_folders_behind(tmp_path, capsys, flags, words) -> None:
    out = tmp_path / "nested" / "head"
    (tmp_path / "a-file").write_text("")
    flags = [flag.replace("{tmp}", str(tmp_path)) for flag in flags]
    argv = ["train-head", "--dtype", "float32", "--out", str(out), "--samples", "1", *flags]
    code, _, err = run_cli(capsys, argv)
    assert code == 2 and words in err, err
    assert not (tmp_path / "nested").exists()  # made for the data, then found empty


class _LogitsAreInputs:
    """A stand-in head whose logits are its outputs (to score chains by hand)."""

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        return g


def test_chain_runs_count_leading_drafts_equal_to_the_target_top1() -> None:
    """Tokens per forward of a chain: each anchor's leading run of correct steps, cut where
    the data leaves the target's greedy choice (the unroll no longer reads the drafts)."""
    v, w = 8, 6
    top = torch.tensor([1, 2, 3, 4, 5, 6])  # the target's top-1 at every position
    window = {"tokens": torch.tensor([0, 1, 2, 3, 4, 5]), "top_index": top[:, None]}
    t2d = torch.arange(v)

    def steps(right: list[list[bool]]) -> list[torch.Tensor]:
        out = []
        for s, rows in enumerate(right, 1):  # step s, anchor i drafts token i+s+1: top[i+s]
            pick = [top[i + s] if ok else 0 for i, ok in enumerate(rows)]
            out.append(torch.nn.functional.one_hot(torch.tensor(pick), v).float()[None])
        return out

    head = _LogitsAreInputs()
    perfect = steps([[True] * (w - 1), [True] * (w - 2)])
    assert chain_runs(head, perfect, window, t2d) == (2 * 4, 4)  # 4 anchors with both steps
    assert chain_runs(head, steps([[False] * 5, [True] * 4]), window, t2d) == (0, 4)
    mixed = steps([[True, True, False, True, True], [False, True, True, True]])
    assert chain_runs(head, mixed, window, t2d) == (1 + 2 + 0 + 2, 4)
    sampled = dict(window, tokens=torch.tensor([0, 1, 2, 7, 4, 5]))  # token 3 was not top-1
    assert chain_runs(head, perfect, sampled, t2d) == (2 + 1 + 2 + 2, 4)  # anchor 1 stops


@pytest.mark.parametrize(
    "spec",
    [
        {"strategy": "speculative", "k": 4, "goodput": False},
        {"strategy": "dspark", "goodput": False},
        {"strategy": "spork", "drafter": "head", "tree": "forks", "goodput": False},
        {"strategy": "spork", "drafter": "head", "tree": "dynamic", "goodput": False},
        {"strategy": "spork", "drafter": "recycle+ngram+head", "goodput": False},
        {"strategy": "speculative", "drafter": "ngram+head", "k": 4, "goodput": False},
        {"strategy": "dspark", "drafter": "ngram+head", "goodput": False},
    ],
    ids=[
        "chain",
        "dspark",
        "spork-forks",
        "spork-dynamic",
        "spork-merged",
        "fallback-chain",
        "fallback-dspark",
    ],
)
def test_the_head_drafts_in_every_strategy_losslessly(smollm_f32, head_dir, spec) -> None:
    """Without the goodput gates (they weigh drafts by timed costs: on a loaded machine an
    8-step head's trees may all be declined) every strategy drafts with the head, and the
    output is plain decoding's."""
    drafter = spec.pop("drafter", "head").replace("head", f"head:{head_dir}")
    config = GenerationConfig(max_new_tokens=32, ignore_eos=True)
    plain = Generator(smollm_f32).generate(PROMPT, config=config)
    result = Generator(smollm_f32, spec=SpecConfig(drafter=drafter, **spec)).generate(
        PROMPT, config=config
    )
    assert result.token_ids == plain.token_ids
    assert result.stats.drafted > 0


def _session(loaded: LoadedModel, head_dir: Path) -> tuple[HeadDrafter, list[int]]:
    """A head drafter for one request that has seen PROMPT's features; the history."""
    return head_session(loaded, head_dir, PROMPT, 42)


def test_a_sampled_head_draft_carries_its_q(smollm_f32, head_dir) -> None:
    """Sampled drafts come with q over the target's vocabulary: zero outside the draft
    vocabulary, each row a distribution, each token drawn from its row."""
    session, history = _session(smollm_f32, head_dir)
    vocab = smollm_f32.model.config.vocab_size
    sampling = SamplingParams(temperature=0.8, seed=1)
    draft = session.propose(history, DraftShape(3), sampling, make_generator(1))
    assert draft.q is not None and draft.q.shape == (3, vocab)
    torch.testing.assert_close(draft.q.sum(-1), torch.ones(3))
    outside = torch.ones(vocab, dtype=torch.bool)
    outside[session.head.d2t] = False
    assert float(draft.q[:, outside].sum()) == 0.0
    assert all(draft.q[i, t] > 0 for i, t in enumerate(draft.tokens.tolist()))


def test_a_metered_head_reports_what_its_proposals_cost(smollm_f32, head_dir) -> None:
    """With a meter the head's cost is the time of its proposals per drafted token over a
    target step (a clock that advances 0.3 s a proposal here), shared by every request's
    drafter, and never below the static estimate."""
    session, history = _session(smollm_f32, head_dir)
    ticks = itertools.count(step=0.3)  # each clock reading 0.3 s after the last
    meter = CostMeter(target_seconds=0.1, floor=0.05, clock=lambda: next(ticks))
    metered = HeadDrafter(session.head, smollm_f32.model, meter=meter)
    assert metered.cost == 0.05  # the floor until a proposal is timed
    request = metered.begin(history[:-1])
    request.features, request.known = session.features, session.known
    draft = request.propose(history, DraftShape(3), SamplingParams(), make_generator(0))
    assert len(draft) == 3
    assert metered.cost == pytest.approx(0.3 / 3 / 0.1)  # one proposal: 0.3 s for 3 tokens
    assert request.cost == metered.cost  # the request's drafter reads the shared meter
    request.propose(history, DraftShape(1), SamplingParams(), make_generator(0))
    assert metered.cost == pytest.approx(0.1 / 0.1)  # the cheaper of 0.1 and 0.3 s a token


class _SlowCatchUp(HeadDrafter):
    """A head whose teacher-forced catch-up takes 5 s of its `now` clock (drafting none)."""

    now = 0.0

    def _catch_up(self, history: list[int]) -> torch.Tensor:
        self.now += 5.0
        return super()._catch_up(history)


def test_the_meter_leaves_out_the_heads_catch_up(smollm_f32, head_dir) -> None:
    """The catch-up over committed positions is paid once per position whenever the head next
    drafts: a price of having the head, not of this round's tokens (counting it made a head
    the gate had turned off look several times dearer, so it stayed off)."""
    session, history = _session(smollm_f32, head_dir)
    meter = CostMeter(target_seconds=0.1, floor=0.05)
    drafter = _SlowCatchUp(session.head, smollm_f32.model, meter=meter)
    meter.clock = lambda: drafter.now
    drafter.features, drafter.known = session.features, session.known
    assert len(drafter.propose(history, DraftShape(3), SamplingParams(), make_generator(0))) == 3
    assert drafter.now == 5.0 and meter.per_token == 0.0 and drafter.cost == 0.05


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, seed=3)])
def test_dspark_stops_the_head_chain_by_its_own_confidence(smollm_f32, head_dir, sampling):
    """DSpark's rule on the head's own top-1 and margin: a chain stops before the first token
    whose confidence is below `low` (here computed by hand from the head's logits)."""
    session, history = _session(smollm_f32, head_dir)
    rng = make_generator(3)
    full = session.propose(history, DraftShape(5), SamplingParams(), rng)
    assert len(full.tokens) == 5
    never = StepConfidence((0.4, 0.3, 0.3), 5.0, ema=0.5, low=1.01)  # C ≤ 1 always
    always = StepConfidence((0.4, 0.3, 0.3), 5.0, ema=0.5, low=0.0)
    assert len(session.propose(history, DraftShape(5, confidence=never), sampling, rng)) == 0
    assert len(session.propose(history, DraftShape(5, confidence=always), sampling, rng)) == 5
    # a threshold between the confidences of the greedy chain's steps cuts it there
    greedy = [float(s) for s in full.scores]  # cumulative q of the greedy tokens
    steps = [greedy[0]] + [b / a for a, b in itertools.pairwise(greedy)]
    assert all(0 < p <= 1 for p in steps)
    rule = StepConfidence((1.0, 0.0, 0.0), 5.0, ema=0.5, low=steps[0] - 1e-6)
    cut = session.propose(history, DraftShape(5, confidence=rule), SamplingParams(), rng)
    expected = next((i for i, p in enumerate(steps) if p < steps[0] - 1e-6), 5)
    assert len(cut) == expected and cut.tokens.tolist() == full.tokens[:expected].tolist()


@pytest.mark.parametrize(("kind", "tolerance"), [("bf16", 0.01), ("q8", 0.03)])
def test_a_head_on_the_kernels_computes_what_the_float_head_does(
    smollm_f32, head_dir, kind, tolerance
) -> None:
    """fuse, a causal catch-up of several rows, a tree step whose rows see different slots,
    and the logits: the kernel head within the packing's rounding of the float head, and the
    keys it caches likewise."""
    kernels = getattr(smollm_f32.model, "kernels", None)
    if kernels is None:
        pytest.skip("the kernels are not available here")
    head = load_head(head_dir, smollm_f32.model.config)
    fast = on_kernels(head, kernels, kind)
    c = head.config

    def rel(want: torch.Tensor, got: torch.Tensor) -> float:
        assert got.shape == want.shape
        return float((got - want).norm() / want.norm())

    def cache() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(1, c.num_kv_heads, 16, c.head_dim), torch.zeros(
            1, c.num_kv_heads, 16, c.head_dim
        )

    torch.manual_seed(0)
    features = torch.randn(6, len(c.feature_layers) * c.hidden_size)  # [T, C·D]
    feats = head.fuse(features)
    assert rel(feats, fast.fuse(features)) < tolerance
    embeds = smollm_f32.model.embed_rows(torch.tensor([5, 17, 300, 9, 41, 1000]))  # [T, D]
    want_cache, got_cache = cache(), cache()
    want = head.rows(embeds, feats, torch.arange(6), want_cache, 0, None)
    got = fast.rows(embeds, feats, torch.arange(6), got_cache, 0, None)
    assert rel(want, got) < tolerance
    assert rel(want_cache[0][:, :, :6], got_cache[0][:, :, :6]) < tolerance
    assert rel(want_cache[1][:, :, :6], got_cache[1][:, :, :6]) < tolerance
    # a tree: node 0 (depth 1) and its two children; every row sees the 4 committed slots
    mask = torch.zeros(3, 9, dtype=torch.bool)  # [T, start + T]
    mask[:, :4] = True
    mask[0, 6], mask[1, [6, 7]], mask[2, [6, 8]] = True, True, True
    positions = torch.tensor([4, 5, 5])
    g = want[:3]  # the rows' features: the head's own outputs
    want = head.rows(embeds[:3], g, positions, want_cache, 6, mask)
    got = fast.rows(embeds[:3], g, positions, got_cache, 6, mask)
    assert rel(want, got) < tolerance
    assert rel(head.logits(want), fast.logits(want)) < 2 * tolerance
    with pytest.raises(ValueError, match="mask"):
        fast.rows(embeds[:3], g, positions, got_cache, 6, mask[:, :8])
    with pytest.raises(ValueError, match="fit"):
        fast.rows(embeds, feats, torch.arange(6), got_cache, 12, None)
    with pytest.raises(ValueError, match="kind"):
        on_kernels(head, kernels, "q3")


def test_a_head_saved_in_bf16_is_the_same_head_rounded(smollm_f32, head_dir, tmp_path) -> None:
    cfg = smollm_f32.model.config
    head = load_head(head_dir, cfg)
    save_head(head, tmp_path / "half", torch.bfloat16)
    half = load_head(tmp_path / "half", cfg)
    size = (tmp_path / "half" / "head.safetensors").stat().st_size
    assert size < 0.6 * (head_dir / "head.safetensors").stat().st_size
    full = head.state_dict()
    for name, value in half.state_dict().items():
        want = full[name].to(torch.bfloat16).float() if value.is_floating_point() else full[name]
        assert value.dtype == full[name].dtype and torch.equal(value, want), name


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
    mismatched = tmp_path / "mismatched"  # a head.json of another run beside these weights
    mismatched.mkdir()
    (mismatched / "head.json").write_text(json.dumps({**meta, "intermediate_size": 1000}))
    (mismatched / "head.safetensors").write_bytes(data)
    with pytest.raises(ConfigError, match=r"head.json does not match head.safetensors \(tensor "):
        load_head(mismatched, cfg)


def test_the_shipped_head_drafts_for_the_default_model(smollm_f32, tmp_path, capsys) -> None:
    """`--drafter head` without a path loads the head shipped for the default model (bfloat16,
    under 20 MB); a trained head's drafts are accepted, and the output stays plain decoding's.
    `train-head --init packaged` starts from it."""
    folder = packaged_head(smollm_f32)
    assert folder.name == "smollm2-135m-instruct"
    assert (folder / "head.safetensors").stat().st_size < 20e6
    config = GenerationConfig(max_new_tokens=48, ignore_eos=True)
    plain = Generator(smollm_f32).generate(PROMPT, config=config)
    spec = SpecConfig("speculative", "head", k=4, goodput=False)
    result = Generator(smollm_f32, spec=spec).generate(PROMPT, config=config)
    assert result.token_ids == plain.token_ids
    assert result.stats.acceptance_rate > 0.05, result.stats  # 15 of 121 when it shipped
    out = tmp_path / "tuned"
    code, _, err = run_cli(
        capsys,
        [
            "train-head",
            "--dtype",
            "float32",
            "--out",
            str(out),
            "--samples",
            "1",
            "--answer-tokens",
            "4",
            "--init",
            "packaged",
            "--steps",
            "1",
            "--window",
            "8",
            "--windows",
            "1",
            "--holdout",
            "0",
        ],
    )
    assert code == 0, err
    cfg = smollm_f32.model.config
    assert load_head(out, cfg).d2t.equal(load_head(folder, cfg).d2t)  # its draft vocabulary
    code, _, err = run_cli(capsys, ["export-head", "packaged", "--out", str(tmp_path / "e3")])
    assert code == 0, err  # for the default model, as vLLM's EAGLE-3 draft
    exported = json.loads((tmp_path / "e3" / "config.json").read_text())
    assert exported["draft_vocab_size"] == len(load_head(folder, cfg).d2t)


@pytest.mark.parametrize(
    "path",
    [
        "~/.cache/specfork/models/SmolLM2-135M-Instruct.Q4_1.gguf",
        "/ckpt/SmolLM2-135M-Instruct",
        "/hf/hub/models--HuggingFaceTB--SmolLM2-135M-Instruct/snapshots/0123abcd",
    ],
)
def test_a_shipped_head_is_found_by_the_model_it_was_trained_for(path, head_dir, tmp_path):
    shipped = tmp_path / "smollm2-135m-instruct"
    shipped.mkdir()
    (shipped / "head.json").write_text((head_dir / "head.json").read_text())
    assert packaged_head(SimpleNamespace(path=Path(path)), root=tmp_path) == shipped
    with pytest.raises(ConfigError, match=r"no draft head ships for other\.gguf"):
        packaged_head(SimpleNamespace(path=Path("/models/other.gguf")), root=tmp_path)


def test_a_greedy_chain_in_one_kernel_call_drafts_what_the_steps_draft(smollm_f32, head_dir):
    """The head on the kernels with the draft vocabulary's embeddings grows a greedy chain in
    one call (`KernelHead.chain`): the same tokens and scores as step by step (the same packed
    head without them), the same DSpark stop, the same cascade check (keep, cut at a token the
    head finds unlikely or outside its vocabulary, extend), and the cache left as it was."""
    kernels = getattr(smollm_f32.model, "kernels", None)
    if kernels is None:
        pytest.skip("the kernels are not available here")
    model = smollm_f32.model
    session, history = _session(smollm_f32, head_dir)
    head = load_head(head_dir, model.config)
    one_call = on_kernels(head, kernels, "q8", model.embed_rows(head.d2t))
    stepped = on_kernels(head, kernels, "q8")
    assert one_call.chains and not stepped.chains

    def drafter(fast: KernelHead) -> HeadDrafter:
        d = HeadDrafter(fast, model).begin(history[:-1])
        d.features, d.known = session.features, session.known
        return d

    fast, slow = drafter(one_call), drafter(stepped)
    greedy, rng = SamplingParams(), make_generator(0)

    def both(call) -> tuple[Draft, Draft]:
        a, b = call(fast), call(slow)
        assert a.tokens.tolist() == b.tokens.tolist()
        torch.testing.assert_close(a.scores, b.scores, rtol=1e-5, atol=1e-7)
        return a, b

    chain, _ = both(lambda d: d.propose(history, DraftShape(6), greedy, rng))
    assert len(chain) == 6
    again, _ = both(lambda d: d.propose(history, DraftShape(6), greedy, rng))
    assert again.tokens.tolist() == chain.tokens.tolist()  # the draft rows left the cache
    # DSpark's rule, halfway between two steps' probabilities, stops both at the same token
    scores = chain.scores.tolist()
    steps = [scores[0]] + [b / a for a, b in itertools.pairwise(scores)]
    low = (sorted(steps)[2] + sorted(steps)[3]) / 2
    rule = StepConfidence((1.0, 0.0, 0.0), 5.0, ema=0.5, low=low)
    cut, _ = both(lambda d: d.propose(history, DraftShape(6, confidence=rule), greedy, rng))
    assert len(cut) == next((i for i, p in enumerate(steps) if p < low), 6)
    # the cascade's check: the head's own chain with its third token swapped for a rare one
    own = chain.tokens.tolist()
    outside = next(t for t in range(model.config.vocab_size) if one_call.t2d[t] < 0)
    inside = int(head.d2t[-1])

    def check(tokens: list[int], depth: int, keep: float) -> Draft:
        return both(lambda d: d.check(history, tokens, DraftShape(depth), greedy, rng, keep))[0]

    for swapped, keep in ((inside, 0.1), (outside, 0.1), (inside, 0.0)):
        checked = check([*own[:2], swapped, *own[3:]], 6, keep)
        assert checked.tokens.tolist()[:2] == own[:2] and len(checked) == 6
        assert (checked.tokens.tolist()[2] == swapped) == (keep == 0.0)
    # keep 0 keeps even a token outside the draft vocabulary: the step path drafts that round
    tokens = [*own[:2], outside]
    assert check(tokens, 4, 0.0).tokens.tolist()[:3] == tokens
