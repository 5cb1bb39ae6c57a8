"""`serve.replicas=N`: engine processes behind a router. The routing policies on their own (no processes),
then two tiny-model replicas end to end: pinned to disjoint cores, same outputs as one engine,
round-robin alternates, least-outstanding balances concurrent streams, shutdown stops both processes.
The end-to-end tests are `slow`: two spawned processes each import torch and build the model (~1 min here)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import aiohttp
import openai
import pytest
from hydra import compose, initialize_config_dir

from lab.engines.ar import AREngine
from lab.kv_cache.counters import PrefixCacheCounters
from lab.request import Request, SamplingParams
from lab.runner import ModelRunner
from lab.serve.app import OpenAIServer, ServeOptions, create_app
from lab.serve.cli import EngineFactory
from lab.serve.engine_loop import EngineStats
from lab.serve.replicas import ReplicaRouter, split_cpus
from lab.serve.server import ServerThread
from lab.spec.counters import SpecCounters
from tests.conftest import CONF_DIR

PROMPT = [17, 230, 4100, 56, 7, 812]


def test_split_cpus_gives_disjoint_sets_and_shares_when_short() -> None:
    assert split_cpus(2, [0, 1, 2, 3, 4]) == [[0, 1], [2, 3]]
    assert split_cpus(3, [4, 5]) == [[4], [5], [4]]


def test_least_outstanding_picks_the_idlest_replica_and_breaks_ties_round_robin() -> None:
    router = ReplicaRouter(EngineFactory({}), 3, "least_outstanding", pin_cpus=False)
    loads = {0: 2, 1: 0, 2: 1}
    for replica in router.replicas:
        replica.sinks.queues = {f"r{i}": None for i in range(loads[replica.index])}  # type: ignore[misc]
    assert router.pick().index == 1
    for replica in router.replicas:
        replica.sinks.queues = {}
    assert [router.pick().index for _ in range(4)] == [1, 2, 0, 1]
    router.router = "round_robin"
    assert [router.pick().index for _ in range(3)] == [2, 0, 1]


def test_router_stats_add_up_the_replicas_spec_and_prefix_cache_counters() -> None:
    """/metrics behind replicas: the router's stats sum every replica's, speculative counts position by position
    (a replica that does not speculate, or has no prefix cache, adds nothing)."""
    router = ReplicaRouter(EngineFactory({}), 3, "round_robin", pin_cpus=False)
    router.replicas[0]._stats = EngineStats(num_running=1, kv_used_bytes=10, spec=SpecCounters(4, 8, 5, (3, 2)),
                                            prefix_cache=PrefixCacheCounters(100, 30))
    router.replicas[1]._stats = EngineStats(num_running=2, kv_used_bytes=5, spec=SpecCounters(2, 4, 1, (1, 0)))
    router.replicas[2]._stats = EngineStats(num_running=1, prefix_cache=PrefixCacheCounters(50, 10))
    total = router.stats()
    assert (total.num_running, total.kv_used_bytes) == (4, 15)
    assert total.spec == SpecCounters(6, 12, 6, (4, 2))
    assert total.prefix_cache == PrefixCacheCounters(150, 40)
    router.replicas[0]._stats = router.replicas[1]._stats = router.replicas[2]._stats = EngineStats()
    assert router.stats().spec is None and router.stats().prefix_cache is None


@pytest.fixture(scope="module")
def replicated(tiny_text_runner: ModelRunner) -> Iterator[tuple[ReplicaRouter, str]]:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="serve", overrides=["model=tiny", "engine=cb_paged"])
    router = ReplicaRouter(EngineFactory.from_cfg(cfg), 2, "round_robin", pin_cpus=True)
    router.launch(timeout_s=300)
    server = OpenAIServer(router, tiny_text_runner.tokenizer, tiny_text_runner.vocab_size, ServeOptions("tiny"))
    with ServerThread(create_app(server)) as thread:
        yield router, thread.url
    for replica in router.replicas:
        assert not replica.process.is_alive(), f"replica {replica.index} still running after shutdown"


@pytest.mark.slow
def test_replicas_are_separate_processes_pinned_to_disjoint_cores(replicated: tuple[ReplicaRouter, str]) -> None:
    router, _ = replicated
    infos = [r.info for r in router.replicas]
    assert len({info.pid for info in infos}) == 2 and os.getpid() not in {info.pid for info in infos}
    if len(os.sched_getaffinity(0)) >= 2:
        assert not set(infos[0].cpus) & set(infos[1].cpus), [info.cpus for info in infos]


@pytest.mark.slow
def test_round_robin_alternates_and_every_replica_matches_one_engine(replicated: tuple[ReplicaRouter, str],
                                                                     tiny_text_runner: ModelRunner) -> None:
    router, url = replicated
    router.router = "round_robin"
    reference = AREngine(tiny_text_runner).run(
        [Request("ref", list(PROMPT), SamplingParams(max_tokens=8, ignore_eos=True))]).requests[0]
    expected = tiny_text_runner.tokenizer.decode(reference.output_token_ids, skip_special_tokens=True)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    before = [r.num_requests for r in router.replicas]
    texts = [client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text for _ in range(4)]
    assert texts == [expected] * 4
    assert [r.num_requests - b for r, b in zip(router.replicas, before)] == [2, 2]


@pytest.mark.slow
def test_least_outstanding_balances_concurrent_streams(replicated: tuple[ReplicaRouter, str]) -> None:
    router, url = replicated
    router.router = "least_outstanding"
    before = [r.num_requests for r in router.replicas]

    async def many() -> list[int]:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "ignore_eos": True}
        async with aiohttp.ClientSession() as session:
            async def one() -> int:
                async with session.post(url + "/v1/completions", json=body) as response:
                    return (await response.json())["usage"]["completion_tokens"]
            return await asyncio.gather(*(one() for _ in range(10)))

    assert asyncio.run(many()) == [24] * 10
    routed = [r.num_requests - b for r, b in zip(router.replicas, before)]
    assert sum(routed) == 10 and abs(routed[0] - routed[1]) <= 2, routed
    assert router.stats().kv_used_bytes == 0 and router.replica_loads() == [0, 0]
