"""`specfork train-head`: make the target's own training data, then train a draft head on it.

Both stages resume: data shards already written are kept, and training continues from the
last checkpoint in the output folder (with the same settings). The result is a folder usable as
`--drafter head:DIR`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from specfork.atomic import output_folder
from specfork.cli.common import add_model_flags, model_options
from specfork.errors import ConfigError
from specfork.threads import torch_threads

if TYPE_CHECKING:
    from specfork.tools.head_train import TrainConfig


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "train-head", help="train a draft head on the target's own features (resumable)"
    )
    add_model_flags(p)
    p.add_argument("--out", type=Path, required=True, help="folder for the head and checkpoints")
    p.add_argument("--data", type=Path, default=None, help="data folder (default: OUT/data)")
    d = p.add_argument_group("data the target makes")
    d.add_argument("--samples", type=int, default=256, help="conversations to make (256)")
    d.add_argument("--answer-tokens", type=int, default=256, help="tokens per answer (256)")
    d.add_argument(
        "--prompts",
        type=Path,
        default=None,
        help="user turns to answer instead of self-written ones: a prompt file (the first "
        "turn's text of each line: plain text, a JSON string, {'prompt': ...}, {'turns': "
        "[...]} or {'messages': [...]}; never Spec-Bench data)",
    )
    d.add_argument(
        "--tasks",
        action="store_true",
        help="user turns from task templates (summaries, extraction, questions on passages, "
        "code, translation, arithmetic, writing) over this Python's standard library docs",
    )
    d.add_argument(
        "--context-tokens",
        type=int,
        default=None,
        help="keep at most this many tokens before each answer (long pasted prompts; default all)",
    )
    d.add_argument("--layers", default=None, help="feature blocks, e.g. 2,15,27 (EAGLE-3's)")
    d.add_argument(
        "--extra-data",
        type=Path,
        action="append",
        default=[],
        help="another data set made earlier for the same target and layers, trained on too "
        "(each keeps its own held-out share); repeatable",
    )
    d.add_argument(
        "--data-only",
        action="store_true",
        help="make (or complete) the data and stop; train on it later with --data or --extra-data",
    )
    t = p.add_argument_group("training")
    t.add_argument(
        "--init",
        default=None,
        metavar="HEAD_DIR",
        help="start from this head's weights and draft vocabulary (fine-tune a head on other "
        "data; a lower --lr suits); 'packaged' = the head shipped for the model; ignored when "
        "resuming",
    )
    t.add_argument("--steps", type=int, default=2000)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--window", type=int, default=256, help="tokens per window (256)")
    t.add_argument("--windows", type=int, default=4, help="windows per step (4)")
    t.add_argument("--unroll", type=int, default=3, help="training-time-test steps (3)")
    t.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size (8192)")
    t.add_argument("--holdout", type=float, default=0.05, help="share held out (0.05)")
    t.add_argument(
        "--checkpoint-every",
        type=int,
        default=100,
        metavar="N",
        help="steps between checkpoints and held-out measurements (100); a measurement runs "
        "the head over every held-out conversation, so large held-out shares want a larger N",
    )
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument(
        "--precision",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="training products: bfloat16 autocast (weights stay float32) or float32; auto = "
        "bfloat16 where the CPU has it natively (~1.6x faster here)",
    )
    t.add_argument(
        "--save-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="precision of the saved head (bfloat16: half the size, as packaged heads ship)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace, err: Console) -> int:
    import torch

    from specfork.heads.model import load_head
    from specfork.heads.packaged import head_folder
    from specfork.loading.loader import load_model
    from specfork.tools.head_data import DataConfig, make_data
    from specfork.tools.head_train import TrainConfig, train_head

    layers = _layers(args.layers)
    prompts = _prompts(args.prompts) if args.prompts else ()
    data_cfg = DataConfig(
        samples=args.samples,
        answer_tokens=args.answer_tokens,
        seed=args.seed,
        feature_layers=layers,
        prompts=prompts,
        tasks=args.tasks,
        context_tokens=args.context_tokens,
    )
    train_cfg = TrainConfig(
        steps=args.steps,
        lr=args.lr,
        window=args.window,
        windows=args.windows,
        unroll=args.unroll,
        draft_vocab=args.draft_vocab,
        seed=args.seed,
        holdout=args.holdout,
        checkpoint_every=args.checkpoint_every,
        weight_decay=args.weight_decay,
        precision=args.precision,
    )
    for extra in args.extra_data:
        if not extra.is_dir():
            raise ConfigError(f"--extra-data {extra} is not a folder of training data")
    data_dir = args.data or args.out / "data"
    new_folders = _missing_folders([args.out, data_dir])  # deepest first
    try:
        output_folder(args.out, "--out")  # before minutes of loading and making data
        if args.data is None or not args.data.is_dir():  # an existing one may only be read
            output_folder(data_dir, "--data")
        with err.status(f"loading {escape(args.model)}…", spinner="dots"):
            loaded = load_model(args.model, progress=False, **model_options(args))
        init = load_head(head_folder(args.init, loaded), loaded.model.config) if args.init else None
        t0 = time.perf_counter()
        with _bar(err) as bar:
            task = bar.add_task("making data", total=args.samples, info="")
            make_data(loaded, data_dir, data_cfg, lambda done, _: bar.update(task, completed=done))
    except BaseException:
        _remove_if_empty(new_folders)  # a refused run leaves no empty folders behind
        raise
    if args.data_only:
        err.print(
            f"data in {data_dir} ({args.samples} samples, {time.perf_counter() - t0:.0f} s); "
            f"train on it with --data {data_dir} or --extra-data {data_dir}",
            markup=False,
            highlight=False,
        )
        return 0
    meta, samples, held_out = _data_sets([data_dir, *args.extra_data], train_cfg)
    tokens = sum(len(s["tokens"]) for s in samples + held_out)
    t1 = time.perf_counter()
    with _bar(err) as bar:
        task = bar.add_task("training", total=train_cfg.steps, info="")

        held: dict[str, Any] = {"value": None, "chain": None}

        def shown(s: Any) -> None:
            if s.held_out is not None:
                held["value"], held["chain"] = s.held_out, s.held_out_chain
            info = f"loss {s.loss:.3f}  top-1 {s.accuracy:.2f}"
            if held["value"] is not None:
                info += f"  held-out top-1 {held['value']:.2f}, {held['chain']:.2f} tok/fwd"
            bar.update(task, completed=s.step, info=info)

        layers = tuple(meta["feature_layers"])
        save_dtype = getattr(torch, args.save_dtype)
        with torch_threads(loaded.model.thread_use().threads):  # training is PyTorch's work
            head = train_head(
                loaded, samples, layers, args.out, train_cfg, shown, save_dtype, held_out, init
            )
    trained = time.perf_counter() - t1
    history = json.loads((args.out / "training.json").read_text())
    chains = [h for h in history if h.get("held_out_chain") is not None]
    best = max(chains, key=lambda h: h["held_out_chain"]) if chains else None
    shown_held = (
        ""
        if best is None
        else (
            f", held-out answers: top-1 agreement {best['held_out']:.2f}, "
            f"{best['held_out_chain']:.2f} tokens per forward in a chain of {train_cfg.unroll} "
            f"(saved: step {best['step']})"
        )
    )
    err.print(
        f"head in {args.out} ({(args.out / 'head.safetensors').stat().st_size / 1e6:.1f} MB "
        f"in {args.save_dtype}, draft vocabulary "
        f"{head.config.draft_vocab}, layers {list(head.config.feature_layers)}); data "
        f"{len(samples) + len(held_out)} samples, {tokens} tokens, {t1 - t0:.0f} s; "
        f"training {trained:.0f} s"
        f"{shown_held} (history: training.json). Use it with --drafter head:{args.out}",
        markup=False,
        highlight=False,
    )
    return 0


def _bar(err: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[info]}"),
        console=err,
        transient=False,
    )


def _missing_folders(paths: Iterable[Path]) -> list[Path]:
    """The folders (and their parents) that do not exist yet, deepest first."""
    missing: set[Path] = set()
    for path in paths:
        path = path.absolute()
        while not path.exists() and path != path.parent:
            missing.add(path)
            path = path.parent
    return sorted(missing, key=lambda p: len(p.parts), reverse=True)


def _remove_if_empty(folders: Iterable[Path]) -> None:
    """Remove the folders this run made that are still empty (a partial data set stays: the
    next run completes it); one that cannot be removed stays, quietly."""
    for folder in folders:
        with contextlib.suppress(OSError):
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()


def _layers(text: str | None) -> tuple[int, ...]:
    if text is None:
        return ()
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"--layers must be block numbers such as 2,15,27, got {text!r}") from None


def _prompts(path: Path) -> tuple[str, ...]:
    from specfork.bench.prompts import load_prompts

    prompts = tuple(p.text for p in load_prompts(path))
    if not prompts:
        raise ConfigError(f"{path} holds no prompts")
    return prompts


def _data_sets(folders: list[Path], cfg: TrainConfig) -> tuple[dict, list, list]:
    """The first folder's meta, and the train and held-out samples of all the folders (each
    split on its own); refused when the sets were made for other targets or layers."""
    from specfork.tools.head_data import load_data
    from specfork.tools.head_train import split_holdout

    if len({f.resolve() for f in folders}) < len(folders):
        raise ConfigError("a data folder is given twice (--data and --extra-data)")
    first, train, held = None, [], []
    for folder in folders:
        meta, samples = load_data(folder)
        shape = {k: meta.get(k) for k in ("target", "hidden_size", "vocab_size", "feature_layers")}
        if first is None:
            first = (meta, shape)
        elif shape != first[1]:
            raise ConfigError(
                f"the data in {folder} was made for {shape}, the data in {folders[0]} for "
                f"{first[1]}; train on data sets of one target and feature layers"
            )
        t, h = split_holdout(samples, cfg)
        train, held = train + t, held + h
    assert first is not None
    return first[0], train, held
