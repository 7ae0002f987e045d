"""Training a draft head on the target's own data (`specfork.tools.head_data`), on a CPU.

Each optimisation step takes `windows` random windows of `window` tokens from the samples and
runs the head with **training-time test** (EAGLE-3): step 1 is teacher forced (position i sees
the target's features f_i and the token x_{i+1}); step s ≥ 2 feeds the head its own step-(s-1)
output at the same anchor with the token x_{i+s}, at position i+s-1, attending to the teacher-
forced keys of positions ≤ i and to its own earlier unrolled keys of that anchor — exactly what
drafting s tokens ahead sees. Every step's prediction is scored against the target's
distribution at that position (its stored top-k, renormalised over the draft vocabulary) with a
soft cross-entropy.

The draft vocabulary is the `draft_vocab` most frequent tokens of the data; the LM head starts
from the target's own rows for them. Checkpoints (`checkpoint.pt`: weights, optimiser, step,
random states) are written atomically every `checkpoint_every` steps; a run started again with
the same folder resumes where it stopped.

At every checkpoint the head is measured on the held-out conversations' last window each (the
answers; the template and user turn come first): step 1's top-1 agreement with the target, and
the **tokens per target forward** a greedy chain of `unroll` drafts would get there (1 + the
leading run of drafts equal to the target's top-1, following the data while it is the target's
greedy choice: exact on greedy answers, a lower bound on sampled ones). The head saved at the
end is the checkpoint with the most held-out tokens per forward.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from specfork.atomic import write_text
from specfork.checks import is_int
from specfork.errors import ConfigError
from specfork.heads.model import DraftHead, HeadConfig, save_head
from specfork.loading.loader import LoadedModel
from specfork.tools.head_data import sample_rows

log = logging.getLogger(__name__)

Sample = Mapping[str, torch.Tensor]  # a stored conversation (`head_data.StoredSample`) or a dict

PRECISIONS = ("auto", "float32", "bfloat16")


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """Optimisation settings of `train_head`."""

    steps: int = 2000
    lr: float = 1e-3
    window: int = 256  # tokens per window
    windows: int = 4  # windows per step (gradients accumulated)
    unroll: int = 3  # training-time test steps
    draft_vocab: int = 8192
    seed: int = 0
    checkpoint_every: int = 100
    holdout: float = 0.05  # share of the samples never trained on (held-out agreement)
    weight_decay: float = 0.0
    precision: str = "auto"  # products: "bfloat16" (autocast), "float32"; auto: bf16 if native

    def __post_init__(self) -> None:
        ints = ("steps", "window", "windows", "unroll", "draft_vocab", "checkpoint_every")
        for name in ints:
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if self.window < self.unroll + 2:
            raise ConfigError(f"window must be at least unroll + 2 = {self.unroll + 2} tokens")
        if not (isinstance(self.lr, int | float) and 0 < self.lr < 1):
            raise ConfigError(f"lr must be in (0, 1), got {self.lr!r}")
        if not (isinstance(self.holdout, int | float) and 0 <= self.holdout < 0.5):
            raise ConfigError(f"holdout must be a share in [0, 0.5), got {self.holdout!r}")
        if not (isinstance(self.weight_decay, int | float) and 0 <= self.weight_decay < 1):
            raise ConfigError(f"weight_decay must be in [0, 1), got {self.weight_decay!r}")
        if self.precision not in PRECISIONS:
            raise ConfigError(
                f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}"
            )

    @property
    def bf16(self) -> bool:
        """Whether products run in bfloat16 (weights, optimiser and loss stay float32)."""
        if self.precision == "auto":
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        return self.precision == "bfloat16"


@dataclass(frozen=True, slots=True)
class StepStats:
    step: int
    loss: float
    accuracy: float  # step-1 top-1 agreement with the target on this step's windows
    held_out: float | None = None  # the same on the held-out samples (at checkpoints)
    held_out_chain: float | None = None  # held-out tokens per forward of an `unroll` chain


def draft_vocabulary(samples: list[Sample], size: int, vocab: int) -> torch.Tensor:
    """The `size` most frequent tokens of the data (targets included), sorted: d2t [Vd]."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for s in samples:
        counts += torch.bincount(s["tokens"].long(), minlength=vocab)[:vocab]
        counts += torch.bincount(s["top_index"][:, 0].long(), minlength=vocab)[:vocab]
    size = min(size, vocab)
    return counts.topk(size).indices.sort().values


def train_head(
    loaded: LoadedModel,
    samples: list[Sample],
    feature_layers: tuple[int, ...],
    folder: Path,
    cfg: TrainConfig,
    progress: Callable[[StepStats], None] | None = None,
    save_dtype: torch.dtype | None = None,
    held_out: list[Sample] | None = None,
    init: DraftHead | None = None,
) -> DraftHead:
    """Train (or resume training) a head; saves it to `folder` (weights in `save_dtype`,
    default float32) and returns it. A new run starts from `init`'s weights and draft
    vocabulary when given (fine-tuning a head on other data), else from the target's rows.

    The held-out samples (default: the last `holdout` share of `samples`, see
    `split_holdout`) are never trained on: at every checkpoint the head's teacher-forced top-1
    agreement with the target there is measured, and the history of training and held-out
    figures is written to `training.json`."""
    model_cfg = loaded.model.config
    folder.mkdir(parents=True, exist_ok=True)
    state = _load_checkpoint(folder / "checkpoint.pt", cfg)
    vocab = model_cfg.vocab_size
    if held_out is None:
        train, held_out = split_holdout(samples, cfg)
    else:
        train, held_out = _usable(samples, cfg), _usable(held_out, cfg)
    if not train:
        raise ConfigError("no sample is long enough to train on")
    if init is not None and tuple(init.config.feature_layers) != tuple(feature_layers):
        raise ConfigError(
            f"the head to start from reads blocks {list(init.config.feature_layers)}, the data "
            f"holds blocks {list(feature_layers)}; make the data with --layers "
            f"{','.join(map(str, init.config.feature_layers))}"
        )
    if state is not None:
        d2t = state["d2t"]
    elif init is not None:
        d2t = init.d2t
    else:
        d2t = draft_vocabulary(train, cfg.draft_vocab, vocab)
    torch.manual_seed(cfg.seed)
    head = DraftHead(HeadConfig.for_target(model_cfg, len(d2t), feature_layers), d2t)
    if state is None and init is not None:
        head.load_state_dict({k: v.float() for k, v in init.state_dict().items()})
    elif state is None:
        _init_from_target(head, loaded)
    opt = torch.optim.AdamW(
        head.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
    )
    trainer = _Trainer(head, loaded, train, held_out, opt, cfg, folder, progress)
    if state is not None:
        trainer.restore(state)
    head.train()
    with torch.inference_mode(False), torch.enable_grad():  # whatever mode the caller is in
        trainer.run()
    head.eval()
    if trainer.best is not None:  # the checkpoint that drafts best on held-out answers
        head.load_state_dict(trainer.best["head"])
        log.info(
            "saving the head of step %d (held-out %.3f tokens per forward)",
            trainer.best["step"],
            trainer.best["chain"],
        )
    save_head(head, folder, save_dtype)
    return head


def split_holdout(samples: list[Sample], cfg: TrainConfig) -> tuple[list[Sample], list[Sample]]:
    """(train, held out) of one data set: its last `cfg.holdout` share is held out (samples
    too short for an unroll are dropped)."""
    usable = _usable(samples, cfg)
    held = int(len(usable) * cfg.holdout) if len(usable) > 1 else 0
    return usable[: len(usable) - held], usable[len(usable) - held :]


def _usable(samples: list[Sample], cfg: TrainConfig) -> list[Sample]:
    return [s for s in samples if len(s["tokens"]) >= cfg.unroll + 2]


class _Trainer:
    """One training run's state: the head, its optimiser, the data split, the step, the
    random windows' generator and the figures so far."""

    def __init__(
        self,
        head: DraftHead,
        loaded: LoadedModel,
        train: list[Sample],
        held_out: list[Sample],
        opt: torch.optim.Optimizer,
        cfg: TrainConfig,
        folder: Path,
        progress: Callable[[StepStats], None] | None,
    ) -> None:
        self.head, self.loaded, self.train, self.held_out = head, loaded, train, held_out
        self.opt, self.cfg, self.folder, self.progress = opt, cfg, folder, progress
        self.t2d = torch.full((loaded.model.config.vocab_size,), -1, dtype=torch.long)
        self.t2d[head.d2t] = torch.arange(len(head.d2t))
        self.step, self.rng = 0, random.Random(cfg.seed)
        self.history: list[dict] = []
        self.best: dict | None = None  # {"step", "chain", "head"} of the best checkpoint

    def restore(self, state: dict) -> None:
        self.head.load_state_dict(state["head"])
        self.opt.load_state_dict(state["optimizer"])
        self.step = state["step"]
        self.rng.setstate(state["rng"])
        self.history = state.get("history", [])
        self.best = state.get("best")

    def run(self) -> None:
        cfg = self.cfg
        while self.step < cfg.steps:
            stats = self._one_step()
            if self.step % cfg.checkpoint_every == 0 or self.step == cfg.steps:
                agreement, chain = self.evaluate()
                stats = StepStats(stats.step, stats.loss, stats.accuracy, agreement, chain)
                self.history.append(dataclasses.asdict(stats))
                if chain is not None and (self.best is None or chain > self.best["chain"]):
                    head = {k: v.detach().clone() for k, v in self.head.state_dict().items()}
                    self.best = {"step": self.step, "chain": chain, "head": head}
                self._checkpoint()
            if self.progress is not None:
                self.progress(stats)

    def _one_step(self) -> StepStats:
        cfg = self.cfg
        for group in self.opt.param_groups:
            group["lr"] = _lr(cfg, self.step)
        self.opt.zero_grad()
        total, correct = 0.0, 0.0
        for _ in range(cfg.windows):
            window = _window(self.train, cfg.window, self.rng)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
                loss, acc = unrolled_loss(self.head, self.loaded, window, self.t2d, cfg.unroll)
            (loss / cfg.windows).backward()
            total, correct = total + float(loss.detach()) / cfg.windows, correct + acc / cfg.windows
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), 1.0)
        self.opt.step()
        self.step += 1
        return StepStats(self.step, total, correct)

    def evaluate(self) -> tuple[float | None, float | None]:
        """On the held-out samples (their last window each): step 1's top-1 agreement with the
        target and a chain's tokens per target forward; (None, None) without a held-out share."""
        if not self.held_out:
            return None, None
        self.head.eval()
        accs, runs, anchors = [], 0, 0
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.cfg.bf16):
            for sample in self.held_out:
                window = _last(sample, self.cfg.window)
                steps = unrolled_steps(self.head, self.loaded, window, self.cfg.unroll)
                accs.append(_soft_ce(self.head, steps[0], window, 1, self.t2d)[1])
                run, n = chain_runs(self.head, steps, window, self.t2d)
                runs, anchors = runs + run, anchors + n
        self.head.train()
        return sum(accs) / len(accs), 1.0 + runs / max(1, anchors)

    def _checkpoint(self) -> None:
        path = self.folder / "checkpoint.pt"
        tmp = path.with_suffix(".tmp")
        state = {
            "head": self.head.state_dict(),
            "optimizer": self.opt.state_dict(),
            "step": self.step,
            "rng": self.rng.getstate(),
            "d2t": self.head.d2t.clone(),
            "config": dataclasses.asdict(self.cfg),
            "history": self.history,
            "best": self.best,
        }
        torch.save(state, tmp)
        tmp.replace(path)
        write_text(self.folder / "training.json", json.dumps(self.history, indent=1))


def _last(sample: Sample, length: int) -> dict[str, torch.Tensor]:
    n = len(sample["tokens"])
    return sample_rows(sample, max(0, n - length), n)


def _lr(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up over 5% of the steps, then cosine decay to 10%."""
    warm = max(1, cfg.steps // 20)
    if step < warm:
        return cfg.lr * (step + 1) / warm
    t = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * t)))


def _window(samples: list[Sample], length: int, rng: random.Random) -> dict:
    s = samples[rng.randrange(len(samples))]
    n = len(s["tokens"])
    start = rng.randrange(0, max(1, n - length + 1))
    return sample_rows(s, start, start + length)


def unrolled_loss(
    head: DraftHead, loaded: LoadedModel, window: dict, t2d: torch.Tensor, unroll: int
) -> tuple[torch.Tensor, float]:
    """Soft cross-entropy of `unroll` training-time-test steps over one window, and step 1's
    top-1 agreement with the target."""
    steps = unrolled_steps(head, loaded, window, unroll)
    loss, acc = _soft_ce(head, steps[0], window, 1, t2d)
    losses = [loss] + [_soft_ce(head, g, window, s, t2d)[0] for s, g in enumerate(steps[1:], 2)]
    return torch.stack(losses).mean(), acc


def unrolled_steps(
    head: DraftHead, loaded: LoadedModel, window: dict, unroll: int
) -> list[torch.Tensor]:
    """The head's outputs of training-time-test steps 1..unroll over one window: step s's
    [1, W - s, D], row i drafting token i + s + 1 from anchor i."""
    tokens = window["tokens"].long()  # [W]
    w = tokens.shape[0]
    with torch.no_grad():
        embeds = loaded.model.embed_rows(tokens).float()[None]  # [1, W, D]
    feats = head.fuse(window["features"].float()[: w - 1])[None]  # [1, T1, D]
    t1 = w - 1
    q, k1, v1 = head.project(embeds[:, 1:], feats, torch.arange(t1))
    g = head.finish(feats, head.attend(q, k1, v1, torch.ones(t1, t1, dtype=torch.bool).tril()))
    steps, unrolled = [g], []
    for s in range(2, unroll + 1):
        n = w - s  # anchors i with a target at position i + s
        if n < 1:
            break
        fin = g[:, :n]
        q, k, v = head.project(embeds[:, s:], fin, torch.arange(n) + s - 1)
        unrolled.append((k, v))
        g = head.finish(fin, _ttt_attention(head, q, k1, v1, unrolled, n))
        steps.append(g)
    return steps


def chain_runs(
    head: DraftHead, steps: list[torch.Tensor], window: dict, t2d: torch.Tensor
) -> tuple[int, int]:
    """(draft tokens a greedy chain of len(steps) would get accepted, anchors): for each anchor
    with every step inside the window, the leading run of steps whose top-1 is the target's.
    The unroll reads the data's tokens, which are the drafts only while the data follows the
    target's greedy choice: the run also ends after a step where it does not."""
    depth = len(steps)
    top1 = t2d[window["top_index"][:, 0].long()]  # [W] the target's top-1 as a draft id, or -1
    greedy = window["tokens"][1:].long() == window["top_index"][:-1, 0].long()  # [W - 1]
    n = steps[-1].shape[1]  # anchors with all `depth` steps
    alive = torch.ones(n, dtype=torch.bool)
    accepted = 0
    for s, g in enumerate(steps, 1):
        hit = head.logits(g[0, :n]).argmax(-1) == top1[s : s + n]  # [n]
        alive &= hit
        accepted += int(alive.sum())
        if s < depth:
            alive &= greedy[s : s + n]  # token i + s + 1 of the data is the target's choice
    return accepted, n


def _ttt_attention(
    head: DraftHead,
    q: torch.Tensor,
    k1: torch.Tensor,
    v1: torch.Tensor,
    unrolled: list[tuple[torch.Tensor, torch.Tensor]],
    n: int,
) -> torch.Tensor:
    """Anchor i attends to teacher-forced keys of positions ≤ i and to its own unrolled keys
    (one per earlier step, the diagonal): q [1, H, n, hd] → [1, H, n, hd]."""
    c = head.config
    rep = c.num_heads // c.num_kv_heads
    k1, v1 = k1.repeat_interleave(rep, 1), v1.repeat_interleave(rep, 1)  # [1, H, T1, hd]
    scale = c.head_dim**-0.5
    s1 = (q @ k1.transpose(-1, -2)) * scale  # [1, H, n, T1]
    causal = torch.ones(n, k1.shape[2], dtype=torch.bool).tril()  # anchor i: positions ≤ i
    s1 = s1.masked_fill(~causal, float("-inf"))
    ks = [k.repeat_interleave(rep, 1)[:, :, :n] for k, _ in unrolled]  # [1, H, n, hd] each
    vs = [v.repeat_interleave(rep, 1)[:, :, :n] for _, v in unrolled]
    diag = torch.stack([(q * k).sum(-1) * scale for k in ks], dim=-1)  # [1, H, n, S-1]
    p = torch.cat((s1, diag), dim=-1).softmax(-1)
    out = p[..., : s1.shape[-1]] @ v1  # [1, H, n, hd]
    for j, v in enumerate(vs):
        out = out + p[..., s1.shape[-1] + j, None] * v
    return out


def _soft_ce(
    head: DraftHead, g: torch.Tensor, window: dict, step: int, t2d: torch.Tensor
) -> tuple[torch.Tensor, float]:
    """-Σ p log q against the target's top-k at positions step..step+n-1 (over the draft
    vocabulary), and the top-1 agreement."""
    n = g.shape[1]
    idx = t2d[window["top_index"][step : step + n].long()]  # [n, k] draft ids or -1
    p = window["top_logp"][step : step + n].float().exp() * (idx >= 0)  # [n, k]
    mass = p.sum(-1, keepdim=True)
    logq = torch.log_softmax(head.logits(g[0]), dim=-1)  # [n, Vd]
    picked = logq.gather(-1, idx.clamp(min=0))  # [n, k]
    rows = mass[:, 0] > 0
    loss = -((p / mass.clamp(min=1e-12)) * picked).sum(-1)[rows].mean()
    acc = float((logq.argmax(-1) == idx[:, 0])[rows].float().mean()) if rows.any() else 0.0
    return loss, acc


def _init_from_target(head: DraftHead, loaded: LoadedModel) -> None:
    """Start the LM head from the target's rows of the draft vocabulary (its logits are linear
    in the hidden state unless soft-capped, so they are read off identity inputs)."""
    model = loaded.model
    if model.config.final_logit_softcapping:
        return
    with torch.no_grad():
        d = model.config.hidden_size
        weight = model.logits(torch.eye(d)).T  # [V, D]
        head.lm_head.weight.copy_(weight[head.d2t].float())


def _load_checkpoint(path: Path, cfg: TrainConfig) -> dict | None:
    """A checkpoint to resume from (None if there is none); refused if made with other
    settings or unreadable."""
    if not path.exists():
        return None
    try:
        state = torch.load(path, weights_only=False)
    except Exception as exc:  # a truncated or foreign file: torch raises several kinds
        raise ConfigError(
            f"the checkpoint {path} is unreadable ({exc}); delete it to start over"
        ) from exc
    # a run may be extended, resumed in another precision or measured at other intervals
    free = ("steps", "precision", "checkpoint_every")
    saved = {k: v for k, v in state.get("config", {}).items() if k not in free}
    wanted = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in free}
    if saved != wanted:
        raise ConfigError(
            f"the checkpoint {path} was made with other settings ({saved}); resume with them "
            "or use another folder"
        )
    return state
