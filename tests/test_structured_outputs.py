"""Structured outputs (JSON schema, JSON object, regex, choice, Lark grammar) on ar, cb_paged and the speculative
engine: every output matches its constraint and ends with EOS once the grammar is complete; the three engines
give the same greedy tokens; verifying drafts under a grammar or under penalties is lossless (each verify row sees
the drafts before it); bad constraints are refused by name."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import pytest

from lab.engines.ar import AREngine
from lab.engines.continuous import ContinuousBatchingEngine
from lab.engines.speculative import SpeculativeEngine
from lab.engines.static import StaticBatchEngine
from lab.errors import LabError
from lab.kv_cache import PagedKVCacheConfig
from lab.models.sources import tiny
from lab.request import Request, RequestStatus, SamplingParams
from lab.runner import ModelRunner
from lab.sample.structured import GrammarCompiler, StructuredOutputsParams
from lab.sched import SchedulerConfig
from lab.spec.draft_model import DraftModelProposerConfig
from lab.spec.eagle import EagleProposerConfig
from lab.spec.ngram_config import NgramProposerConfig
from lab.spec.proposer import Draft
from lab.spec.tree import row_prefixes
from lab.workloads.base import SamplingDefaults
from tests.helpers import make_requests

KV = PagedKVCacheConfig(block_size=4, num_blocks=256, kv_cache_memory_mb=None)
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer", "n"], "additionalProperties": False}
CONSTRAINTS = {
    "json": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    "regex": StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}"),
    "choice": StructuredOutputsParams(choice=["yes", "no", "it \"depends\""]),
    "grammar": StructuredOutputsParams(grammar='start: "(" NUM ("," NUM)* ")"\nNUM: /[1-9]/'),
}


class ScriptedProposer:
    """Drafts the next k tokens of a known answer, every third draft with its second token replaced by
    `wrong_token`: accepted drafts, a rejection, and rows after a draft the grammar refuses, in one run."""

    feature_layers: tuple[int, ...] = ()

    def __init__(self, answers: dict[str, list[int]], wrong_token: int) -> None:
        self.answers, self.wrong_token, self.num_drafts = answers, wrong_token, 0

    def propose(self, requests: list[Request], num_spec_tokens: int, generators: list) -> dict[str, Draft]:
        drafts = {}
        for request in requests:
            start = request.num_output_tokens
            tokens = list(self.answers[request.request_id][start:start + num_spec_tokens])
            self.num_drafts += 1
            if self.num_drafts % 3 == 0 and len(tokens) > 1:
                tokens[1] = self.wrong_token
            drafts[request.request_id] = Draft(tokens)
        return drafts

    def free(self, request_id: str) -> None:
        pass

    def reset_history(self) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {}


@dataclass
class ScriptedProposerConfig:
    answers: dict[str, list[int]]
    wrong_token: int

    def build(self, target: ModelRunner, kv: object) -> ScriptedProposer:
        return ScriptedProposer(self.answers, self.wrong_token)


def cb_paged(runner: ModelRunner) -> ContinuousBatchingEngine:
    return ContinuousBatchingEngine(runner, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), KV)


def speculative(runner: ModelRunner, proposer) -> SpeculativeEngine:
    return SpeculativeEngine(runner, proposer, num_spec_tokens=3, kv_cache=KV,
                             scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))


def constrained_requests(runner: ModelRunner, max_tokens: int = 24, **params) -> list[Request]:
    prompt = runner.tokenizer.encode("Answer in the format asked:")
    return [Request(name, prompt, SamplingParams(max_tokens=max_tokens, structured_outputs=constraint, **params))
            for name, constraint in CONSTRAINTS.items()]


def text(runner: ModelRunner, request: Request) -> str:
    return runner.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)


def check_matches(runner: ModelRunner, request: Request) -> None:
    """A finished request's text matches its constraint and ended with EOS; one cut at max_tokens is a prefix."""
    output = text(runner, request)
    if request.status is RequestStatus.FINISHED_LENGTH:
        return
    assert request.status is RequestStatus.FINISHED_STOPPED and request.output_token_ids[-1] in runner.eos_token_ids
    if request.request_id == "json":
        value = json.loads(output)
        assert set(value) == {"answer", "n"} and value["answer"] in ("yes", "no") and 0 <= value["n"] <= 9, output
    elif request.request_id == "regex":
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", output), output
    elif request.request_id == "choice":
        assert output in ("yes", "no", 'it "depends"'), output
    else:
        assert re.fullmatch(r"\([1-9](,[1-9])*\)", output), output


def test_every_engine_follows_the_constraints_with_the_same_greedy_tokens(tiny_text_runner: ModelRunner) -> None:
    expected = AREngine(tiny_text_runner).run(constrained_requests(tiny_text_runner)).requests
    for request in expected:
        check_matches(tiny_text_runner, request)
    assert {r.request_id for r in expected if r.status is RequestStatus.FINISHED_STOPPED} >= {"json", "regex", "choice"}
    answers = {r.request_id: r.output_token_ids for r in expected}
    wrong = tiny_text_runner.tokenizer.convert_tokens_to_ids("x")   # breaks every constraint here but the regex's
    scripted = speculative(tiny_text_runner, ScriptedProposerConfig(answers, wrong))
    # NOTE: the draft is the target itself, unconstrained: it breaks the grammar at once, so every draft is rejected
    unconstrained = speculative(tiny_text_runner, DraftModelProposerConfig(source=tiny(seed=0)))
    for engine in (cb_paged(tiny_text_runner), scripted, unconstrained):
        done = engine.run(constrained_requests(tiny_text_runner)).requests
        assert [r.error for r in done] == [None] * len(done), engine.name
        assert {r.request_id: r.output_token_ids for r in done} == answers, engine.name
    stats = scripted.stats()
    assert 0 < stats["spec_decode_accepted_tokens"] < stats["spec_decode_draft_tokens"]


def test_the_tokens_a_grammar_forces_are_drafted_and_accepted(tiny_text_runner: ModelRunner) -> None:
    """engine.grammar_drafts: a JSON key the schema forces is drafted whole and verified in one step; the output
    stays the plain engine's, greedy or sampled."""
    schema = {"type": "object", "properties": {"a_rather_long_property_name": {"enum": [1, 2]},
                                               "another_long_property_name": {"type": "boolean"}},
              "required": ["a_rather_long_property_name", "another_long_property_name"], "additionalProperties": False}
    constraint = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    prompt = tiny_text_runner.tokenizer.encode("JSON please:")

    def run(engine, **params) -> list[int]:
        params = {"max_tokens": 40, "structured_outputs": constraint, **params}
        return engine.run([Request("j", prompt, SamplingParams(**params))]).requests[0].output_token_ids

    for params in ({}, {"temperature": 1.0, "seed": 5}):
        expected = run(AREngine(tiny_text_runner), **params)
        assert json.loads(tiny_text_runner.tokenizer.decode(expected, skip_special_tokens=True))
        # NOTE: n-gram lookup finds nothing in this prompt: every draft is one the grammar forced
        forced = speculative(tiny_text_runner, NgramProposerConfig(min_n=3, max_n=3))
        plain = speculative(tiny_text_runner, NgramProposerConfig(min_n=3, max_n=3))
        plain.grammar_drafts = False
        if not params:
            assert run(forced, **params) == expected and run(plain, **params) == expected
        else:   # NOTE: verifying draws its random numbers in another order than sampling does
            run(forced, **params)
        stats = forced.stats()
        assert stats["spec/grammar_forced_drafts"] > 0 and stats["spec/grammar_forced_draft_tokens"] >= 8
        assert stats["spec_decode_accepted_tokens"] >= stats["spec/grammar_forced_draft_tokens"] - 2
    assert plain.stats()["spec/grammar_forced_drafts"] == 0


def test_sampled_outputs_follow_the_constraints_and_a_seed_repeats_them(tiny_text_runner: ModelRunner) -> None:
    first = AREngine(tiny_text_runner).run(constrained_requests(tiny_text_runner, temperature=1.0, seed=3)).requests
    again = cb_paged(tiny_text_runner).run(constrained_requests(tiny_text_runner, temperature=1.0, seed=3)).requests
    assert [r.output_token_ids for r in again] == [r.output_token_ids for r in first]
    # NOTE: verifying draws its random numbers in another order than sampling does: valid, not the same tokens
    drafted = speculative(tiny_text_runner, DraftModelProposerConfig(source=tiny(seed=0))).run(
        constrained_requests(tiny_text_runner, temperature=1.0, seed=3)).requests
    for request in first + drafted:
        assert request.error is None
        check_matches(tiny_text_runner, request)


def test_json_object_and_whitespace(tiny_text_runner: ModelRunner) -> None:
    prompt = tiny_text_runner.tokenizer.encode("{")
    params = SamplingParams(max_tokens=48, structured_outputs=StructuredOutputsParams(json_object=True),
                            logit_bias={tiny_text_runner.tokenizer.encode("}")[0]: 30.0})   # closes the object early
    request = AREngine(tiny_text_runner).run([Request("o", prompt, params)]).requests[0]
    assert isinstance(json.loads(text(tiny_text_runner, request)), dict)


def test_a_complete_grammar_wins_over_min_tokens_and_ignore_eos_keeps_emitting_eos(
        tiny_text_runner: ModelRunner) -> None:
    choice = StructuredOutputsParams(choice=["yes", "no"])
    prompt = tiny_text_runner.tokenizer.encode("Yes or no?")
    held = AREngine(tiny_text_runner).run([Request("m", prompt, SamplingParams(
        max_tokens=8, min_tokens=5, structured_outputs=choice))]).requests[0]
    assert held.error is None and text(tiny_text_runner, held) in ("yes", "no")
    assert held.status is RequestStatus.FINISHED_STOPPED
    kept = AREngine(tiny_text_runner).run([Request("e", prompt, SamplingParams(
        max_tokens=6, ignore_eos=True, structured_outputs=choice))]).requests[0]
    assert kept.error is None and kept.status is RequestStatus.FINISHED_LENGTH
    assert text(tiny_text_runner, kept) in ("yes", "no")


@pytest.mark.parametrize("proposer", ["draft_equals_target", "eagle_tree"])
def test_verifying_drafts_under_penalties_is_lossless(proposer: str, tiny_source, tiny_runner: ModelRunner) -> None:
    """Each verify row is penalised with the drafts before it counted: greedy output equals `ar`'s under the same
    penalties, for a chain and for a tree of drafts."""
    prompts = [[5, 17, 99, 5, 17, 99, 5, 17], [3, 44, 12, 3, 44], [70, 71, 72, 73, 70, 71, 72]]
    params = {"repetition_penalty": 1.3, "frequency_penalty": 0.4, "presence_penalty": 0.2, "logit_bias": {9: 2.0},
              "min_tokens": 10, "stop_token_ids": [11], "bad_words_token_ids": [[17, 99], [12]]}
    expected = [r.output_token_ids for r in AREngine(tiny_runner).run(make_requests(prompts, 16, **params)).requests]
    config = (DraftModelProposerConfig(source=tiny_source) if proposer == "draft_equals_target" else
              EagleProposerConfig(checkpoint=None, tree_width=3, draft_vocab_size=0))
    engine = speculative(tiny_runner, config)
    done = engine.run(make_requests(prompts, 16, **params)).requests
    assert [r.output_token_ids for r in done] == expected
    stats = engine.stats()
    assert stats["spec_decode_accepted_tokens"] > 0 and stats["spec_decode_acceptance_rate"] < 100.0


def test_row_prefixes_follow_the_chain_or_the_tree() -> None:
    assert row_prefixes([7, 8, 9], None) == [[], [7], [7, 8], [7, 8, 9]]
    # root ── 7 ── 8      (a tree: 7 and 6 are candidates for the first position, 8 follows 7)
    #    └── 6
    assert row_prefixes([7, 8, 6], [-1, 0, -1]) == [[], [7], [7, 8], [6]]


def test_a_draft_the_grammar_refuses_leaves_the_matcher_where_it_was(tiny_text_runner: ModelRunner) -> None:
    tokenizer = tiny_text_runner.tokenizer
    grammar = GrammarCompiler(tokenizer).compile(StructuredOutputsParams(regex=r"(a|b)[0-9]+"))
    a, b, one, x = (tokenizer.convert_tokens_to_ids(t) for t in ("a", "b", "1", "x"))
    assert grammar.allowed()[a] and grammar.allowed()[b] and not grammar.allowed()[one]
    assert grammar.allowed([a])[one] and not grammar.allowed([a])[b]
    assert grammar.allowed([a, one])[one] and not grammar.allowed([a, one])[x]
    # NOTE: x breaks the grammar: the rows after it get the mask where the valid drafts end (after "a")
    assert grammar.allowed([a, x, one]).equal(grammar.allowed([a]))
    assert grammar.allowed()[b] and grammar.num_consumed == 0   # every draft rolled back
    grammar.catch_up([a, one])
    assert grammar.allowed()[one] and not grammar.is_terminated
    with pytest.raises(LabError, match="the output broke its grammar"):
        grammar.catch_up([a, one, x])


def test_bad_constraints_are_refused_by_name(tiny_text_runner: ModelRunner, tiny_runner: ModelRunner) -> None:
    for fields, message in [({}, "exactly one of json, regex, choice, grammar, json_object; got none"),
                            ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
                            ({"choice": "yes"}, "choice must be a list of non-empty strings"),
                            ({"choice": ["yes", ""]}, "choice must be a list of non-empty strings"),
                            ({"choice": []}, "choice must be a list of non-empty strings"),
                            ({"json": "{not json"}, "the JSON schema is not valid JSON")]:
        with pytest.raises(LabError, match=re.escape(message)):
            StructuredOutputsParams(**fields)
    engine = AREngine(tiny_text_runner)
    for fields, message in [({"regex": "[a-"}, "the regex constraint does not compile"),
                            ({"grammar": "start: ("}, "the grammar constraint does not compile"),
                            ({"json": {"type": "no-such-type"}}, "the json constraint does not compile")]:
        constraint = StructuredOutputsParams(**fields)
        with pytest.raises(LabError, match=message):
            engine.validate(Request("bad", [1, 2], SamplingParams(structured_outputs=constraint)))
    regex = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))
    with pytest.raises(LabError, match="structured outputs need the model's tokenizer"):
        AREngine(tiny_runner).validate(Request("ids", [1, 2], regex))
    with pytest.raises(LabError, match="engine static does not apply penalties, logit_bias, min_tokens, allowed_"):
        StaticBatchEngine(tiny_text_runner, batch_size=2).validate(Request("s", [1, 2], regex))


def test_offline_runs_take_a_constraint_from_the_sampling_settings() -> None:
    params = SamplingDefaults(structured_outputs={"choice": ["a", "b"]}).params(max_tokens=4, ignore_eos=False)
    assert params.structured_outputs == StructuredOutputsParams(choice=("a", "b"))
    with pytest.raises(LabError, match=r"sampling.structured_outputs has unknown keys \['schema'\]"):
        SamplingDefaults(structured_outputs={"schema": {}}).params(max_tokens=4, ignore_eos=False)
