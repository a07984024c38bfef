"""TextTracker: text, stop strings and token trimming from cumulative token ids; OutputProcessor:
stop strings reported, never acted on (host only)."""

from __future__ import annotations

from jaxinfer.engine.outputs import OutputProcessor, TextTracker
from jaxinfer.request import CompletionOutput, Request, RequestOutput, RequestStatus
from jaxinfer.sampling_params import SamplingParams
from tests.serve.fake_engine import FakeTokenizer

TOK = FakeTokenizer()


def ids(text: str) -> list[int]:
    return TOK.encode(text)


def output(token_ids, finished=False, finish_reason=None) -> RequestOutput:
    c = CompletionOutput(0, "", list(token_ids), finish_reason=finish_reason)
    return RequestOutput("r", None, ids("p"), [c], finished)


def test_text_without_stops_equals_a_full_decode_in_any_chunking():
    text = "héllo wörld, ça va? 日本"
    all_ids = ids(text)
    for chunk in (1, 2, 5, len(all_ids)):
        tracker = TextTracker(TOK, ids("p"), SamplingParams())
        for end in range(chunk, len(all_ids) + chunk, chunk):
            out = tracker.apply(output(all_ids[:end], finished=end >= len(all_ids),
                                       finish_reason="length" if end >= len(all_ids) else None))
        assert out.outputs[0].text == text
        assert out.finished and out.outputs[0].finish_reason == "length"


def test_stop_ends_at_the_token_that_completed_it_whatever_the_chunking():
    all_ids = ids("abc STOP def")
    params = SamplingParams(stop=["STOP"])
    for chunk in (1, 3, 7, len(all_ids)):
        tracker = TextTracker(TOK, ids("p"), params)
        out = None
        for end in range(chunk, len(all_ids) + chunk, chunk):
            out = tracker.apply(output(all_ids[:end]))
            if out.finished:
                break
        c = out.outputs[0]
        assert out.finished and c.finish_reason == "stop" and c.stop_reason == "STOP"
        assert c.text == "abc "
        assert c.token_ids == ids("abc STOP")  # trimmed: not the tokens after the stop
        again = tracker.apply(output(all_ids))  # later outputs change nothing
        assert again.outputs[0].token_ids == c.token_ids and again.outputs[0].text == "abc "


def test_include_stop_and_holdback_while_running():
    tracker = TextTracker(TOK, ids("p"), SamplingParams(stop=["STOP"], include_stop_str_in_output=True))
    out = tracker.apply(output(ids("abc ST")))
    assert not out.finished and out.outputs[0].text == "abc "  # "ST" may become the stop
    out = tracker.apply(output(ids("abc STOP!")))
    assert out.finished and out.outputs[0].text == "abc STOP"
    assert out.outputs[0].token_ids == ids("abc STOP")


def test_stop_in_the_final_flush_and_none_found():
    tracker = TextTracker(TOK, ids("p"), SamplingParams(stop=["zz"]))
    out = tracker.apply(output(ids("abc"), finished=True, finish_reason="length"))
    assert out.outputs[0].text == "abc" and out.outputs[0].finish_reason == "length"


def test_output_processor_reports_stop_strings_and_leaves_requests_alone():
    proc = OutputProcessor(TOK)
    stopping = Request("a", ids("p"), SamplingParams(stop=["STOP"]), status=RequestStatus.RUNNING)
    plain = Request("b", ids("p"), SamplingParams(), status=RequestStatus.RUNNING)
    for req in (stopping, plain):
        proc.add(req, "p")
    for t in ids("abc STOP def"):
        stopping.append_output_token(t, 0.0)
    for t in ids("xy"):
        plain.append_output_token(t, 0.0)
    assert proc.update_text([stopping, plain]) == [("a", "STOP")]
    assert stopping.status is RequestStatus.RUNNING  # finishing it is the engine's call
    stopping.status, stopping.stop_reason = RequestStatus.FINISHED_STOPPED, "STOP"  # as finished
    a, b = proc.process([stopping, plain])
    assert a.finished and a.outputs[0].text == "abc " and a.outputs[0].token_ids == ids("abc STOP")
    assert a.outputs[0].finish_reason == "stop" and a.outputs[0].stop_reason == "STOP"
    assert not b.finished and b.outputs[0].text == "xy" and b.prompt == "p"
    assert proc.process([stopping]) == []  # a finished request's track is gone
    tokens_only = proc.process([plain], detokenize=False)[0]
    assert tokens_only.outputs[0].text == "" and tokens_only.outputs[0].token_ids == ids("xy")


def test_stop_strings_count_only_after_min_tokens():
    """As vLLM: a stop string in the text of the first min_tokens tokens does not stop the
    request; one completed after them does."""
    all_ids = ids("ab STOP cd STOP ef")
    for chunk in (1, 4, len(all_ids)):
        tracker = TextTracker(TOK, ids("p"), SamplingParams(stop=["STOP"], min_tokens=8))
        out = None
        for end in range(chunk, len(all_ids) + chunk, chunk):
            out = tracker.apply(output(all_ids[:end], finished=end >= len(all_ids),
                                       finish_reason="length" if end >= len(all_ids) else None))
            if out.finished:
                break
        c = out.outputs[0]
        assert (c.finish_reason, c.stop_reason) == ("stop", "STOP")
        assert c.text == "ab STOP cd " and c.token_ids == ids("ab STOP cd STOP")


def test_the_stop_tokens_text_is_left_out_unless_asked_for():
    """A request that ended on a stop token (stop_token_ids, or EOS) keeps the token in its ids
    and leaves its text out, as vLLM; include_stop_str_in_output keeps the text."""
    all_ids = ids("abc!")
    stop = all_ids[-1]
    for include, want in ((False, "abc"), (True, "abc!")):
        for chunk in (1, len(all_ids)):
            tracker = TextTracker(TOK, ids("p"), SamplingParams(
                stop_token_ids=[stop], include_stop_str_in_output=include))
            for end in range(chunk, len(all_ids) + chunk, chunk):
                done = end >= len(all_ids)
                c = CompletionOutput(0, "", all_ids[:end], finish_reason="stop" if done else None,
                                     stop_reason=stop if done else None)
                out = tracker.apply(RequestOutput("r", None, ids("p"), [c], done))
            assert out.outputs[0].text == want and out.outputs[0].token_ids == all_ids
    tracker = TextTracker(TOK, ids("p"), SamplingParams(skip_special_tokens=False))
    eos = TOK.eos_token_ids[0]
    c = CompletionOutput(0, "", ids("ab") + [eos], finish_reason="stop", stop_reason=None)
    assert tracker.apply(RequestOutput("r", None, ids("p"), [c], True)).outputs[0].text == "ab"
    c = CompletionOutput(0, "", ids("ab") + [eos], finish_reason="length")
    tracker = TextTracker(TOK, ids("p"), SamplingParams(skip_special_tokens=False))
    assert tracker.apply(RequestOutput("r", None, ids("p"), [c], True)).outputs[0].text == "ab</s>"


def test_a_completed_grammar_keeps_its_last_tokens_text():
    """A request whose grammar completed ends with "stop" and no stop_reason on a token of its
    text (no EOS): that text stays."""
    tracker = TextTracker(TOK, ids("p"), SamplingParams())
    c = CompletionOutput(0, "", ids('{"a": 1}'), finish_reason="stop", stop_reason=None)
    assert tracker.apply(RequestOutput("r", None, ids("p"), [c], True)).outputs[0].text == '{"a": 1}'
