"""`specfork export-model` and `specfork export-head`: checkpoints for other engines.

`export-model` writes any model specfork loads (packaged name, .gguf, folder) as a Hugging Face
folder (config.json, model.safetensors, tokenizer); `export-head --format eagle3` writes a
trained draft head in the EAGLE-3 layout vLLM serves as a speculative draft (docs/vllm.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from specfork.loading.registry import DEFAULT_MODEL


def add_parser(sub: Any) -> None:
    m = sub.add_parser(
        "export-model",
        help="write a model as a Hugging Face folder (config, safetensors, tokenizer)",
        description="Dequantizes a GGUF (or re-saves a folder) into a folder transformers and "
        "vLLM load: config.json, model.safetensors, tokenizer.json + tokenizer_config.json "
        "(chat template) and generation_config.json.",
    )
    m.add_argument(
        "--model",
        "-m",
        default=DEFAULT_MODEL,
        help=f"packaged model name, .gguf file or checkpoint folder ({DEFAULT_MODEL})",
    )
    _add_out_flags(m)
    m.set_defaults(run=run_model)

    h = sub.add_parser(
        "export-head",
        help="write a trained draft head for another engine (EAGLE-3 layout for vLLM)",
        description="Writes a specfork head folder (head.json + head.safetensors) as an "
        "EAGLE-3 draft checkpoint: vLLM serves it with --speculative-config "
        '\'{"method": "eagle3", "model": OUT}\' next to the exported target.',
    )
    h.add_argument(
        "head",
        type=Path,
        help="the head folder (from specfork train-head); 'packaged' = the head shipped for "
        "--model",
    )
    h.add_argument("--format", default="eagle3", choices=("eagle3",), help="layout (eagle3)")
    h.add_argument(
        "--model",
        "-m",
        default=None,
        help="the target model: check that the head was trained for it",
    )
    _add_out_flags(h)
    h.set_defaults(run=run_head)


def _add_out_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, required=True, help="folder to write")
    p.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16"), help="weights (float32)"
    )
    p.add_argument(
        "--force", action="store_true", help="write into a non-empty --out (replace its files)"
    )


def run_model(args: argparse.Namespace, err: Console) -> int:
    from specfork.tools.export_model import ModelExport, export_model

    spec = ModelExport(model=args.model, out=args.out, dtype=args.dtype, force=args.force)
    with err.status(f"exporting {escape(args.model)}…", spinner="dots"):
        out = export_model(spec)
    err.print(f"exported {escape(args.model)} to {escape(str(out))} ({args.dtype})")
    return 0


def run_head(args: argparse.Namespace, err: Console) -> int:
    from specfork.tools.export_eagle3 import HeadExport, export_head

    head, target = args.head, args.model
    if str(head) == "packaged" and not head.exists():  # the head shipped for the target
        from specfork.heads.packaged import head_folder
        from specfork.loading.registry import DEFAULT_MODEL, resolve_model

        target = target or DEFAULT_MODEL
        head = head_folder(head, resolve_model(target, progress=False))
    spec = HeadExport(
        head=head,
        out=args.out,
        format=args.format,
        target=target,
        dtype=args.dtype,
        force=args.force,
    )
    out = export_head(spec)
    err.print(f"exported the head {escape(str(head))} to {escape(str(out))} ({args.format})")
    return 0
