"""What a greedy chain of the shipped draft head costs: step by step against one kernel call.

The same packed head (q8, as `specfork` builds it) drafts greedy chains of each depth after the
same prompt, once through Python a step at a time (two kernel calls, an argmax and an
embedding per step) and once as `KernelHead.chain` (one call); the two are interleaved, after a
warm-up, and must draft the same tokens. Prints the median milliseconds of a proposal (the
head's catch-up of the last position included, as in decoding).

    python benchmarks/head_chain.py --depths 1 2 4 8 --repeats 300
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch

from specfork.config import SamplingParams
from specfork.drafters.base import DraftShape, Feedback
from specfork.drafters.head import HeadDrafter
from specfork.engine.generator import Generator
from specfork.heads.fast import on_kernels
from specfork.heads.model import load_head
from specfork.heads.packaged import packaged_head
from specfork.loading.loader import load_model

log = logging.getLogger("head_chain")
PROMPT = "Write a short story about a robot who learns to paint, in five paragraphs."


def session(loaded, head, ids: list[int]) -> HeadDrafter:
    """A head drafter that has seen the prompt's features, as after prefill."""
    drafter = HeadDrafter(head, loaded.model).begin(ids)
    with torch.inference_mode():
        _, hidden = loaded.model.extend_capturing(
            ids, loaded.model.new_cache(len(ids) + 8), head.config.feature_layers
        )
    drafter.observe(Feedback(len(ids), torch.tensor(ids), [], None, hidden, prompt=True))
    return drafter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--repeats", type=int, default=300)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    loaded = load_model("smollm2-135m-instruct", progress=False)
    kernels = getattr(loaded.model, "kernels", None)
    if kernels is None:
        raise SystemExit("the kernels are not available on this machine")
    head = load_head(packaged_head(loaded), loaded.model.config)
    stepped = on_kernels(head, kernels, "q8")
    one_call = on_kernels(head, kernels, "q8", loaded.model.embed_rows(head.d2t))
    ids = Generator(loaded).encode_prompt(PROMPT)
    drafters = {
        name: session(loaded, h, ids) for name, h in (("stepped", stepped), ("one call", one_call))
    }
    history, greedy, rng = [*ids, ids[-1]], SamplingParams(), torch.Generator()
    log.info("| depth | stepped (ms) | one call (ms) | one call / stepped | same tokens |")
    log.info("|---|---|---|---|---|")
    for depth in args.depths:
        shape = DraftShape(depth)
        times: dict[str, list[float]] = {name: [] for name in drafters}
        drafts = {}
        for i in range(args.repeats + 20):  # the first 20: warm-up
            for name, drafter in drafters.items():
                start = time.perf_counter()
                drafts[name] = drafter.propose(history, shape, greedy, rng).tokens.tolist()
                if i >= 20:
                    times[name].append(time.perf_counter() - start)
        a, b = (1e3 * statistics.median(times[n]) for n in drafters)
        same = drafts["stepped"] == drafts["one call"]
        log.info("| %d | %.3f | %.3f | %.2f | %s |", depth, a, b, b / a, "yes" if same else "NO")


if __name__ == "__main__":
    main()
