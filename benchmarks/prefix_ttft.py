"""Time to first token with and without a prefix-cache hit: a long shared system prompt.

Requests share a system prompt of about `--system-tokens` tokens and differ in their question.
For each question, in one process and interleaved: the scheduler with an empty prefix cache
(a miss: the whole prompt is prefilled), then with the shared prompt already cached (a hit:
only the question is prefilled). Prints median TTFT of each and their ratio, and checks that
both give the same greedy tokens.

    python benchmarks/prefix_ttft.py --system-tokens 1000 --questions 6
"""

from __future__ import annotations

import argparse
import statistics

from specfork.config import GenerationConfig
from specfork.engine.batch import BatchConfig, Scheduler
from specfork.engine.generator import Generator
from specfork.engine.lifecycle import GenerationResult
from specfork.loading.loader import load_model
from specfork.loading.registry import DEFAULT_MODEL

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for better sleep.",
    "How do I reverse a list in Python?",
    "Summarize the rules above in one sentence.",
    "What should I pack for a beach trip?",
    "Explain photosynthesis to a child.",
    "Name two prime numbers above 50.",
    "Write a haiku about autumn.",
]
RULE = "Rule {i}: answer politely, cite the policy section {i} when relevant, and keep it short. "


def system_prompt(generator: Generator, tokens: int) -> str:
    """Numbered rules until the text holds about `tokens` tokens."""
    text, i = "", 0
    while len(generator.tokenizer.encode(text)) < tokens:
        i += 1
        text += RULE.format(i=i)
    return text


def run(scheduler: Scheduler, chat: list[dict], config: GenerationConfig) -> GenerationResult:
    scheduler.add(chat, config=config)
    while scheduler.running:
        for update in scheduler.step():
            if update.result is not None:
                return update.result
    raise RuntimeError("the request ended without a result")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--questions", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=16)
    args = p.parse_args()
    generator = Generator(load_model(args.model, progress=False))
    generator.warm_up()
    system = system_prompt(generator, args.system_tokens)
    config = GenerationConfig(max_new_tokens=args.max_tokens, ignore_eos=True)
    cached = Scheduler(generator, BatchConfig(max_running=1, prefix_cache_bytes=1 << 30))
    run(cached, [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}], config)
    miss, hit = [], []
    for question in (QUESTIONS * 4)[: args.questions]:
        chat = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        cold = run(Scheduler(generator, BatchConfig(max_running=1)), chat, config)
        warm = run(cached, chat, config)
        if warm.token_ids != cold.token_ids:
            raise SystemExit(f"a cache hit changed the output for {question!r}")
        miss.append(cold.stats.time_to_first_token)
        hit.append(warm.stats.time_to_first_token)
    cached_tokens = warm.stats.cached_prompt_tokens
    print(f"{generator.model.describe()}; prompt {cold.stats.prompt_tokens} tokens, "
          f"{cached_tokens} cached")  # fmt: skip
    t_miss, t_hit = statistics.median(miss), statistics.median(hit)
    print(f"TTFT miss {1000 * t_miss:.1f} ms, hit {1000 * t_hit:.1f} ms, "
          f"{t_miss / t_hit:.1f}x; same tokens: yes")  # fmt: skip


if __name__ == "__main__":
    main()
