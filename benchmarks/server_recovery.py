"""Does the server answer the next client as fast as before a burst of hostile requests?

Starts `specfork serve`'s app on the default model (its default precision, kernels), measures
the latency of a plain greedy request (median of `--repeats`), sends a burst of hostile
requests — the costliest a request may ask for (stopped by the deadline), bodies refused with
4xx, streams abandoned mid-way, requests cancelled while queued — and measures again. Prints
every hostile request's status and time, and the two medians with their ratio.

    python benchmarks/server_recovery.py --repeats 7 --timeout 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import httpx

from specfork.engine.generator import Generator
from specfork.engine.thread import model_thread, run_in
from specfork.loading.loader import load_model
from specfork.loading.registry import DEFAULT_MODEL
from specfork.server.app import create_app
from specfork.server.run import serve_in_background

NORMAL = {"prompt": "The three primary colours are", "max_tokens": 32, "temperature": 0}
HEAVY = {
    "strategy": "spork",
    "drafter": "recycle+self",
    "skip_layers": "4-25",
    "tree": "dynamic",
    "budget": 64,
    "forks": 8,
    "depth": 8,
    "adapt": False,
}
HOSTILE: list[tuple[str, dict | bytes, dict]] = [
    (
        "heaviest allowed tree",
        {**NORMAL, "max_tokens": 2000, "ignore_eos": True, "speculative": HEAVY},
        {},
    ),
    (
        "stop string holding text back",
        {**NORMAL, "max_tokens": 2000, "ignore_eos": True, "stop": [" " * 512]},
        {},
    ),
    (
        "forks 64 x depth 64",
        {
            **NORMAL,
            "speculative": {
                "strategy": "spork",
                "drafter": "self",
                "forks": 64,
                "depth": 64,
                "adapt": False,
            },
        },
        {},
    ),
    ("NaN temperature", b'{"prompt": "hi", "temperature": NaN}', {}),
    ("boolean as number", {**NORMAL, "speculative": {"strategy": "speculative", "k": True}}, {}),
    ("lone surrogate", b'{"prompt": "\\ud800"}', {}),
    ("nested 100k deep", b"[" * 100_000, {}),
    ("9 MB body", b'{"prompt": "' + b"a" * 9_000_000 + b'"}', {}),
    ("text/plain body", json.dumps(NORMAL).encode(), {"content-type": "text/plain"}),
    ("foreign Host", NORMAL, {"host": "evil.example"}),
]


def _post(url: str, body: dict | bytes, headers: dict) -> tuple[int, float]:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    hdrs = {"content-type": "application/json", **headers}
    t0 = time.perf_counter()
    resp = httpx.post(f"{url}/v1/completions", content=content, headers=hdrs, timeout=600)
    return resp.status_code, time.perf_counter() - t0


def _latencies(url: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        status, seconds = _post(url, NORMAL, {})
        assert status == 200, status
        out.append(seconds)
    return out


def _abandon_streams(url: str, n: int) -> None:
    """Open n long streams and drop each after its first chunk; n more dropped while queued."""
    body = {**NORMAL, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    hdrs = {"content-type": "application/json"}

    def one() -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=hdrs) as r:
            for _ in r.iter_lines():
                break

    threads = [threading.Thread(target=one) for _ in range(2 * n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--timeout", type=float, default=5.0, help="the server's --request-timeout")
    args = p.parse_args()
    thread = model_thread()
    gen = run_in(thread, lambda: Generator(load_model(DEFAULT_MODEL, progress=False)))
    run_in(thread, gen.warm_up)
    app = create_app(gen, model_name="m", thread=thread, request_timeout=args.timeout)
    with serve_in_background(app) as url:
        _latencies(url, 2)  # warm-up
        before = _latencies(url, args.repeats)
        for name, body, headers in HOSTILE:
            status, seconds = _post(url, body, headers)
            print(f"{name:32s} HTTP {status}  {seconds:6.2f} s")
        _abandon_streams(url, 4)
        print(f"{'8 abandoned streams':32s} done")
        after = _latencies(url, args.repeats)
    b, a = statistics.median(before), statistics.median(after)
    print(
        f"normal request, median of {args.repeats}: before {b * 1000:.1f} ms, "
        f"after {a * 1000:.1f} ms, after / before {a / b:.3f}"
    )


if __name__ == "__main__":
    main()
