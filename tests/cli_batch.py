"""Run several `specfork` command lines in one fresh process (tests that need environment
variables read at import time, such as huggingface_hub's HF_ENDPOINT and HF_HUB_CACHE).

    python tests/cli_batch.py '[["generate", "-m", "x", "hi"], ["models"]]'

prints one JSON list of {"code", "out", "err"}, one per command line, in order. A line
["@resolve", MODEL] runs `resolve_model(MODEL)` instead: "out" is the path it returns.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys

from specfork.cli import main
from specfork.loading.registry import resolve_model


def run(argv: list[str]) -> dict:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        if argv[0] == "@resolve":
            print(resolve_model(argv[1], progress=False))
            code = 0
        else:
            code = main(argv)
    return {"code": code, "out": out.getvalue(), "err": err.getvalue()}


if __name__ == "__main__":
    results = [run(argv) for argv in json.loads(sys.argv[1])]
    sys.__stdout__.write("\n" + json.dumps(results) + "\n")
