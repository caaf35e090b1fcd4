"""The output processor alone, no model: tokens the scheduler has appended become deltas; a stop
string ends a choice (and wins over a length stop in the same token), the n choices of a request
fan in to one output, logprobs add up, and a failure in one request's detokenization fails that
request alone. It only reports what must end; ending it in the scheduler is EngineCore's."""

from __future__ import annotations

import pytest

from kvfleet.engine.model_runner import StepResult
from kvfleet.engine.output_processor import OutputProcessor
from kvfleet.engine.request import EngineRequest, Request, RequestStatus
from kvfleet.engine.sampling_params import SamplingParams

PROMPT = [0, 1]


class CharTokenizer:
    """Token i is the letter chr(ord('a') + i)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


def tokens(text: str) -> list[int]:
    return [ord(c) - ord("a") for c in text]


def admitted(processor: OutputProcessor, rid: str, **params: object) -> list[Request]:
    request = EngineRequest(PROMPT, SamplingParams(**params), max_tokens=16)
    n = request.params.n
    children = [
        Request(f"{rid}#{i}", PROMPT, request.params, frozenset(), request.max_tokens)
        for i in range(n)
    ]
    processor.add_request(rid, request, children)
    return children


def step(processor: OutputProcessor, reqs: list[Request], sampled: list[int], **kwargs):
    """As the scheduler's update would: append each request's token, then process the step."""
    for req, token in zip(reqs, sampled, strict=True):
        req.append_token(token)
    logprobs = kwargs.pop("logprobs", [None] * len(reqs))
    return processor.process(StepResult(reqs, sampled, logprobs, **kwargs))


def test_a_stop_string_ends_one_choice_and_the_request_fans_in():
    processor = OutputProcessor(CharTokenizer())
    a, b = admitted(processor, "r", n=2, stop=["cd"])

    def texts(out) -> list[tuple[int, str, str | None, object]]:
        return [(c.index, c.text, c.finish_reason, c.stop_reason) for c in out.outputs["r"].outputs]

    # The last character could start the stop string: each choice holds it back.
    assert texts(step(processor, [a, b], tokens("xx"))) == [
        (0, "", None, None),
        (1, "", None, None),
    ]
    assert texts(step(processor, [a, b], tokens("cy"))) == [
        (0, "x", None, None),
        (1, "x", None, None),
    ]
    out = step(processor, [a, b], tokens("dz"))
    # The stop string is never streamed; the other choice runs on.
    assert texts(out) == [(0, "", "stop", "cd"), (1, "y", None, None)]
    assert out.to_finish == [(a, RequestStatus.FINISHED_STOPPED)]
    assert not out.outputs["r"].finished

    b.status = RequestStatus.FINISHED_LENGTH  # the scheduler's length stop
    out = step(processor, [b], tokens("w"))
    assert texts(out) == [(1, "zw", "length", None)]
    assert out.outputs["r"].finished and out.to_finish == []
    assert processor.num_requests == 0


def test_a_stop_string_wins_over_a_length_stop_in_the_same_token():
    processor = OutputProcessor(CharTokenizer())
    (req,) = admitted(processor, "r", stop=["ab"])
    step(processor, [req], tokens("a"))
    req.status = RequestStatus.FINISHED_LENGTH
    out = step(processor, [req], tokens("b"))
    [choice] = out.outputs["r"].outputs
    assert (choice.finish_reason, choice.stop_reason, choice.text) == ("stop", "ab", "")
    assert out.outputs["r"].finished


def test_logprobs_add_up_per_choice():
    processor = OutputProcessor(None)
    (req,) = admitted(processor, "r", logprobs=1)
    first = step(processor, [req], [3], logprobs=[(-0.5, [(4, -0.25)])])
    second = step(processor, [req], [4], logprobs=[(-1.0, [(4, -1.0)])])
    c1, c2 = first.outputs["r"].outputs[0], second.outputs["r"].outputs[0]
    assert c1.logprobs == [{3: -0.5, 4: -0.25}] and c1.cumulative_logprob == -0.5
    assert c2.logprobs == [{4: -1.0}] and c2.cumulative_logprob == -1.5
    assert c1.text == c2.text == ""  # no tokenizer, no text


@pytest.mark.parametrize("stage", ["sampling", "detokenization"])
def test_a_failure_fails_its_request_alone(stage, monkeypatch):
    processor = OutputProcessor(CharTokenizer())
    victims = admitted(processor, "victim", n=2)
    (bystander,) = admitted(processor, "bystander")
    reqs = [*victims, bystander]
    failed = {}
    if stage == "sampling":
        failed = {1: RuntimeError("planted")}
    else:
        detok = processor._parents["victim"].detokenizers[1]

        def planted(token_id: int) -> str | None:
            raise RuntimeError("planted")

        monkeypatch.setattr(detok, "add_token", planted)
    out = step(processor, reqs, tokens("abc"), failed=failed)
    victim = out.outputs["victim"]
    assert victim.finished and victim.error == f"{stage} failed: planted"
    assert [c.finish_reason for c in victim.outputs] == ["error", "error"]
    assert out.to_finish == [(r, RequestStatus.FINISHED_ERROR) for r in victims]
    assert out.outputs["bystander"].outputs[0].text == "c"
    assert processor.num_requests == 1 and processor.has_request("bystander")
