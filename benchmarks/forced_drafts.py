"""Required tool calls: speculation with and without drafting the tokens the grammar forces.

Each conversation of specfork's agent workload (src/specfork/bench/workload_data/agent.jsonl,
written for specfork) becomes a request as an OpenAI client sends it with `tools` and
`tool_choice: "required"`: the workload's system prompt up to its tool list, the tools
(parsed from the JSON schemas that list holds) described by `engine.tool_calls.with_tools`,
the first user turn, and the output constrained to one call (`call_schema`). Every variant
runs on a Generator of its own (a suffix index learns from the earlier prompts of its own
variant only), prompt by prompt with the variants interleaved, after one warm-up request
each; greedy unless `--temperature`. Speedup: decode tokens/s over plain decoding's on the
same prompt, the median over prompts, and over all tokens (every prompt's tokens over every
prompt's decode seconds, against plain decoding's); every variant's output is compared with plain
decoding's (greedy: token for token; sampled outputs differ by design).

    python benchmarks/forced_drafts.py [--max-new-tokens 128] [--temperature 0.0]
        [--variants ar speculative:suffix ...]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from dataclasses import dataclass, field
from importlib import resources

from specfork import Constraint, GenerationConfig, Generator, SamplingParams, load_model
from specfork.config import SpecConfig
from specfork.engine.tool_calls import Tool, call_schema, with_tools

log = logging.getLogger("forced_drafts")

VARIANTS = (
    "ar",
    "speculative:ngram:off",
    "speculative:ngram",
    "speculative:suffix:off",
    "speculative:suffix",
    "dspark:suffix",
    "spork:recycle+suffix:off",
    "spork:recycle+suffix",
)


@dataclass
class Tally:
    speedups: list[float] = field(default_factory=list)
    tokens_per_forward: list[float] = field(default_factory=list)
    matches: int = 0
    runs: int = 0
    grammar: list[int] = field(default_factory=lambda: [0, 0])  # drafted, accepted
    seconds: float = 0.0  # decode seconds, summed over prompts
    tokens: int = 0
    forwards: int = 0


def requests() -> list[tuple[str, list[dict[str, str]], list[Tool]]]:
    """(id, messages, tools) of every agent conversation's first turn."""
    text = resources.files("specfork.bench").joinpath("workload_data/agent.jsonl").read_text()
    out = []
    for line in text.splitlines():
        row = json.loads(line)
        intro, _, listing = row["system"].partition("You can use these tools")
        tools = []
        for entry in listing.splitlines():
            if entry.startswith("{"):
                spec = json.loads(entry)
                tools.append(Tool(spec["name"], spec["description"], spec["parameters"]))
        messages = [{"role": "system", "content": intro.strip()}]
        messages.append({"role": "user", "content": row["turns"][0]})
        out.append((row["question_id"], with_tools(messages, tools), tools))
    return out


def spec_of(variant: str) -> SpecConfig | None:
    """`strategy:drafter[:off]` (off: --no-grammar-drafts); None for plain decoding."""
    if variant == "ar":
        return None
    strategy, drafter, *rest = variant.split(":")
    return SpecConfig(strategy, drafter=drafter, grammar_drafts=rest != ["off"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("specfork").setLevel(logging.WARNING)  # not every DSpark round
    loaded = load_model("smollm2-135m-instruct")
    gens = {v: Generator(loaded, spec=spec_of(v)) for v in ["ar", *args.variants] if v}
    sampling = SamplingParams(temperature=args.temperature)
    work = requests()

    def run(variant: str, messages: list, tools: list[Tool]):
        config = GenerationConfig(
            max_new_tokens=args.max_new_tokens,
            constraint=Constraint.json_schema(call_schema(tools)),
        )
        return gens[variant].generate(messages, config=config, sampling=sampling)

    for variant in gens:  # warm-up
        run(variant, work[0][1], work[0][2])
    tallies = {v: Tally() for v in gens}
    for i, (name, messages, tools) in enumerate(work[1:]):
        order = list(gens)
        order = order[i % len(order) :] + order[: i % len(order)]  # rotate who goes first
        results = {v: run(v, messages, tools) for v in order}
        plain = results["ar"]
        for variant, res in results.items():
            tally, stats = tallies[variant], res.stats
            tally.runs += 1
            tally.matches += res.token_ids == plain.token_ids
            plain_speed = plain.stats.decode_tokens_per_second
            tally.speedups.append(stats.decode_tokens_per_second / plain_speed)
            tally.tokens_per_forward.append(stats.mean_accepted_length)
            tally.seconds += stats.new_tokens / stats.decode_tokens_per_second
            tally.tokens += stats.new_tokens
            tally.forwards += stats.target_forwards
            drafted, accepted = stats.by_source.get("grammar", [0, 0])
            tally.grammar[0] += drafted
            tally.grammar[1] += accepted
        log.info("%s: %s", name, plain.text[:100])
    print(f"{len(work) - 1} prompts (after 1 warm-up), temperature {args.temperature}")
    print(
        "| variant | speedup (median) | speedup (all tokens) | tokens/forward (median) | "
        "forwards/tokens | same output as ar | grammar drafted / accepted |"
    )
    print("|---|---|---|---|---|---|---|")
    plain = tallies["ar"]
    for variant, t in tallies.items():
        same = f"{t.matches}/{t.runs}" if sampling.greedy else "n/a (sampled)"
        overall = (t.tokens / t.seconds) / (plain.tokens / plain.seconds)
        print(
            f"| {variant} | {statistics.median(t.speedups):.2f}× | {overall:.2f}× | "
            f"{statistics.median(t.tokens_per_forward):.2f} | {t.forwards}/{t.tokens} | "
            f"{same} | {t.grammar[0]} / {t.grammar[1]} |"
        )


if __name__ == "__main__":
    main()
