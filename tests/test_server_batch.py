"""The server's continuous batching: jobs queued together run in one batch, each gets the text
it gets alone, a cancelled job leaves the batch at the next step, `max_running` bounds the
batch, and the step metrics are exported. A tiny random model keeps it fast."""

from __future__ import annotations

import asyncio
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from specfork.config import GenerationConfig, SamplingParams, SpecConfig
from specfork.constraint import Constraint
from specfork.engine.batch import BatchConfig, Scheduler
from specfork.engine.generator import Generator
from specfork.errors import ConstraintError
from specfork.loading.loader import LoadedModel, load_model
from specfork.models.cost import CostCurve
from specfork.server.app import create_app
from specfork.server.metrics import ServerMetrics
from specfork.server.run import serve_in_background
from specfork.server.worker import (
    EngineWorker,
    Event,
    Job,
    ServerSettings,
    make_batch,
    request_failure,
)
from tiny_models import tiny_chat_llama

CURVE = CostCurve((1, 2, 4, 8, 16, 32), (1.0, 1.25, 1.5, 2.3, 3.9, 6.8))
PROMPTS = ["abc abc abc abc", "the cat sat on the mat", "x y z x y z", "hello", "one two one two"]
SPECS = [None, SpecConfig("speculative", "ngram", k=4), SpecConfig("spork", "recycle+ngram")]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory, one_thread) -> LoadedModel:
    folder = tiny_chat_llama(tmp_path_factory.mktemp("tiny"), chat=False, seed=5)
    return load_model(str(folder), dtype="float32", progress=False)


def _ids(gen: Generator, prompt: str) -> list[int]:
    return gen.prompt_ids(prompt, chat=False)


async def _events(job: Job) -> list[Event]:
    events = []
    while not events or events[-1].kind not in ("done", "error"):
        events.append(await asyncio.wait_for(job.next_event(), timeout=120))
    return events


def test_jobs_queued_together_run_in_one_batch_with_their_lone_outputs(
    loaded: LoadedModel,
) -> None:
    gen = Generator(loaded, cost_curve=CURVE)
    config = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    cases = [(p, SPECS[i % len(SPECS)]) for i, p in enumerate(PROMPTS * 2)]
    alone = [gen.generate(p, chat=False, config=config, spec=s).text for p, s in cases]

    async def scenario() -> list[list[Event]]:
        metrics = ServerMetrics()
        worker = EngineWorker(gen, metrics, ServerSettings("tiny", max_running=8))
        jobs = [Job(_ids(gen, p), config, SamplingParams(), s, deltas=True) for p, s in cases]
        for job in jobs:
            worker.submit(job)  # all queued before the worker starts: they join together
        worker.start()
        try:
            events = [await _events(job) for job in jobs]
        finally:
            worker.stop()
        text = metrics.render().decode()
        count = float(re.search(r"^specfork_batch_size_count (\S+)$", text, re.M).group(1))
        total = float(re.search(r"^specfork_batch_size_sum (\S+)$", text, re.M).group(1))
        assert total / count > 2  # steps held several requests
        assert re.search(r"^specfork_requests_running 0\.0$", text, re.M)
        return events

    results = asyncio.run(scenario())
    for events, expected in zip(results, alone, strict=True):
        assert events[0].kind == "start" and events[-1].kind == "done"
        streamed = "".join(e.text for e in events if e.kind == "delta")
        assert events[-1].result.text == expected == streamed


def test_a_cancelled_job_leaves_the_batch_and_the_others_finish(loaded: LoadedModel) -> None:
    gen = Generator(loaded, cost_curve=CURVE)
    config = GenerationConfig(max_new_tokens=400, ignore_eos=True)

    async def scenario() -> None:
        worker = EngineWorker(gen, ServerMetrics(), ServerSettings("tiny", max_running=4))
        jobs = [Job(_ids(gen, p), config, SamplingParams(), None, deltas=True) for p in PROMPTS[:2]]
        for job in jobs:
            worker.submit(job)
        worker.start()
        try:
            for job in jobs:  # both started and streaming
                while (await asyncio.wait_for(job.next_event(), 120)).kind != "delta":
                    pass
            handle = next(s.handle for s in list(worker._jobs.values()) if s.job is jobs[0])
            jobs[0].cancel()
            events = await _events(jobs[1])
            assert events[-1].result.stats.new_tokens == 400
            assert handle.finished and handle.req.out.finish_reason == "cancelled"
            assert handle.req.stats.new_tokens < 400
            batch = worker._batch
            assert isinstance(batch, Scheduler) and not batch.running
        finally:
            worker.stop()

    asyncio.run(scenario())


def test_max_running_bounds_the_batch_over_http(loaded: LoadedModel) -> None:
    """Through the HTTP API, with one request decoding at a time: every step holds one
    request, and the texts are those of the library."""
    gen = Generator(loaded, cost_curve=CURVE)
    app = create_app(gen, model_name="tiny", max_running=1)
    body = {"max_tokens": 20, "temperature": 0, "ignore_eos": True}
    with serve_in_background(app) as url, ThreadPoolExecutor(3) as pool:

        def post(prompt: str) -> str:
            resp = httpx.post(f"{url}/v1/completions", json={**body, "prompt": prompt}, timeout=120)
            assert resp.status_code == 200, resp.text
            return resp.json()["choices"][0]["text"]

        texts = list(pool.map(post, PROMPTS[:3]))
        metrics = httpx.get(f"{url}/metrics").text
    config = GenerationConfig(max_new_tokens=20, ignore_eos=True)
    assert texts == [gen.generate(p, chat=False, config=config).text for p in PROMPTS[:3]]
    count = float(re.search(r"^specfork_batch_size_count (\S+)$", metrics, re.M).group(1))
    ones = float(
        re.search(r'^specfork_batch_size_bucket\{le="1.0"\} (\S+)$', metrics, re.M).group(1)
    )
    assert count > 0 and ones == count


def test_max_running_is_validated() -> None:
    with pytest.raises(Exception, match="max_running must be an integer >= 1"):
        ServerSettings("tiny", max_running=0)


def test_step_rows_sets_the_rows_of_a_step(loaded: LoadedModel) -> None:
    """--step-rows bounds every forward the worker runs (prompt chunks fill what decoding
    leaves, outputs unchanged); by default a step holds max(128, max_running) rows."""
    gen = Generator(loaded, cost_curve=CURVE)
    assert make_batch(gen, ServerSettings("tiny", max_running=4)).config.step_rows == 128
    assert make_batch(gen, ServerSettings("tiny", max_running=200)).config.step_rows == 200
    batch = make_batch(gen, ServerSettings("tiny", max_running=2, step_rows=8))
    assert isinstance(batch, Scheduler) and batch.config.step_rows == 8
    config = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    prompts = [PROMPTS[1] * 3, PROMPTS[4] * 3]
    alone = [gen.generate(p, chat=False, config=config).text for p in prompts]
    handles = [batch.add(p, chat=False, config=config) for p in prompts]
    rows, texts = [], {}
    while batch.running:
        texts.update({id(u.running): u.result.text for u in batch.step() if u.result})
        rows.append(batch.last_step().rows)
    assert max(rows) <= 8 and rows.count(8) >= 4  # the prompts were read in 8-row chunks
    assert [texts[id(h)] for h in handles] == alone


def test_a_kv_budget_holds_the_next_job_until_memory_frees(loaded: LoadedModel) -> None:
    """With room for one request's KV cache, queued jobs run one after another, in order, each
    with its lone output; a cap cannot starve a job (one alone always runs)."""
    gen = Generator(loaded, cost_curve=CURVE)
    config = GenerationConfig(max_new_tokens=10, ignore_eos=True)
    one = gen.model.new_cache(256)  # the smallest cache a request gets
    budget_mb = (one.k.nbytes + one.v.nbytes) / 2**20
    expected = [gen.generate(p, chat=False, config=config).text for p in PROMPTS[:3]]

    async def scenario() -> None:
        metrics = ServerMetrics()
        settings = ServerSettings("tiny", max_running=8, kv_budget_mb=budget_mb)
        worker = EngineWorker(gen, metrics, settings)
        jobs = [
            Job(_ids(gen, p), config, SamplingParams(), None, deltas=False) for p in PROMPTS[:3]
        ]
        for job in jobs:
            worker.submit(job)
        worker.start()
        try:
            results = [(await _events(job))[-1].result.text for job in jobs]
        finally:
            worker.stop()
        assert results == expected
        text = metrics.render().decode()
        count = float(re.search(r"^specfork_batch_size_count (\S+)$", text, re.M).group(1))
        ones = re.search(r'^specfork_batch_size_bucket\{le="1.0"\} (\S+)$', text, re.M)
        assert count > 0 and float(ones.group(1)) == count

    asyncio.run(scenario())


class _BrokenGrammar:
    """Stands in for a request's grammar that fails in the middle of decoding (a fault of that
    request alone: its masks, its drafter or its sampler)."""

    finished = False

    def __getattr__(self, name: str):
        raise RuntimeError(f"broken grammar ({name})")


def test_a_request_that_fails_in_a_step_leaves_alone(loaded: LoadedModel) -> None:
    """The failing request leaves the batch with its error and its cache freed; the others
    finish with their lone outputs."""
    gen = Generator(loaded, cost_curve=CURVE)
    config = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    alone = [gen.generate(p, chat=False, config=config).text for p in PROMPTS[:3]]
    batch = Scheduler(gen, BatchConfig(max_running=4))
    handles = [batch.add(_ids(gen, p), config=config) for p in PROMPTS[:3]]
    updates = batch.step() + batch.step()  # prompts read, first tokens out: all decoding
    assert not any(h.prefilling for h in handles)
    handles[1].req.grammar = _BrokenGrammar()
    while batch.running:
        updates += batch.step()
    failed = [u for u in updates if u.error is not None]
    assert [u.running for u in failed] == [handles[1]]
    assert "broken grammar" in str(failed[0].error)
    assert handles[1].finished and handles[1].req.out.finish_reason == "error"
    texts = {id(u.running): u.result.text for u in updates if u.result is not None}
    assert texts == {id(handles[0]): alone[0], id(handles[2]): alone[2]}


def test_a_grammar_that_matches_nothing_fails_only_its_own_job(loaded: LoadedModel) -> None:
    """A 400 naming response_format for it; its neighbours in the batch finish normally."""
    gen = Generator(loaded, cost_curve=CURVE)
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    bad = GenerationConfig(max_new_tokens=40, constraint=Constraint.regex(r"[^\s\S]"))
    alone = [gen.generate(p, chat=False, config=config).text for p in PROMPTS[:2]]

    async def scenario() -> list[list[Event]]:
        worker = EngineWorker(gen, ServerMetrics(), ServerSettings("tiny", max_running=4))
        jobs = [Job(_ids(gen, p), config, SamplingParams(), None, deltas=True) for p in PROMPTS[:2]]
        jobs.insert(1, Job(_ids(gen, PROMPTS[2]), bad, SamplingParams(), None, deltas=True))
        for job in jobs:
            worker.submit(job)
        worker.start()
        try:
            return [await _events(job) for job in jobs]
        finally:
            worker.stop()

    first, refused, second = asyncio.run(scenario())
    error = refused[-1].error
    assert refused[-1].kind == "error" and error.status == 400
    assert error.param == "response_format" and "matches no text" in error.message
    assert [first[-1].result.text, second[-1].result.text] == alone


def test_a_constraint_over_the_mask_budget_is_a_400_and_its_neighbours_go_on(
    loaded: LoadedModel,
) -> None:
    """`max_mask_ms`: over HTTP a constraint dearer than the budget is refused with a 400
    naming response_format (here every constraint is, the budget being a nanosecond); a request
    whose grammar grows dear mid-decode ends with the same 400 while the batch goes on; a
    JSON `"stop": null` is no stop string, as in OpenAI's API."""
    gen = Generator(loaded, cost_curve=CURVE)
    app = create_app(gen, model_name="tiny", max_mask_ms=1e-6)
    body = {"prompt": "abc", "max_tokens": 4, "temperature": 0, "stop": None}
    with serve_in_background(app) as url:
        fmt = {"type": "regex", "regex": "[a-z]+"}
        refused = httpx.post(f"{url}/v1/completions", json={**body, "response_format": fmt})
        plain = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "response_format" and error["code"] == "invalid_response_format"
    assert "to enforce per token, over the limit of 1e-06 ms" in error["message"]
    assert plain.status_code == 200, plain.text

    config = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    dear = GenerationConfig(
        max_new_tokens=30, ignore_eos=True, max_mask_ms=1e6, constraint=Constraint.regex("[a-z ]+")
    )
    alone = gen.generate(PROMPTS[0], chat=False, config=config).text
    batch = Scheduler(gen, BatchConfig(max_running=4))
    handles = [
        batch.add(_ids(gen, PROMPTS[0]), config=config),
        batch.add(_ids(gen, PROMPTS[1]), config=dear),
    ]
    updates = batch.step() + batch.step()  # prompts read, first tokens out: both decoding
    assert not handles[1].finished
    handles[1].req.grammar.mask_budget = 1e-12  # its masks grow dear
    while batch.running:
        updates += batch.step()
    failed = [u for u in updates if u.error is not None]
    assert [u.running for u in failed] == [handles[1]]
    assert isinstance(failed[0].error, ConstraintError)
    error = request_failure(failed[0].error)  # what the server answers for it
    assert error.status == 400 and error.param == "response_format"
    assert [u.result.text for u in updates if u.result is not None] == [alone]
