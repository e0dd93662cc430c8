"""The OpenAI parameters beyond plain sampling, piece by piece (no engine): request validation,
logprobs bodies in vLLM's shapes, one choice's events, and the n-sample fan-out's order (the
prompt prefilled once, the further samples started only once the first decodes). The real path
is tested in tests/e2e/test_openai_params.py."""

import asyncio

import msgspec
import pytest
from pydantic import ValidationError

from conductor.choices import Choice, Echo, LogprobsWanted
from conductor.errors import APIError
from conductor.logprobs import CompletionLogprobs, TokenText, chat_content, prompt_logprobs_body
from conductor.relay import Relay, RelayStats
from conductor.routing import Route
from conductor.schemas import ChatCompletionRequest, CompletionRequest
from conductor.workers import WorkerHandle
from mooncake.protocol import ENCODER, GenerateChunk, Sampling

CHAT = [{"role": "user", "content": "x"}]


class LetterTokenizer:
    """Token i is the letter chr(ord('a') + i); 26 is a stop-free end marker."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i) for i in ids)

    def convert_ids_to_tokens(self, ids):
        return [self.decode([i]) for i in ids]


# -- validation ------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields", [{"n": 0}, {"n": 17}, {"logprobs": 21}, {"logprobs": -1}, {"prompt_logprobs": 21}])
def test_out_of_range_values_are_refused_by_the_schema(fields):
    with pytest.raises(ValidationError):
        CompletionRequest(model="m", prompt="a", **fields)


@pytest.mark.parametrize("request_type,fields", [(CompletionRequest, {"prompt": "a"}),
                                                 (ChatCompletionRequest, {"messages": CHAT})])
def test_stream_options_need_a_stream(request_type, fields):
    with pytest.raises(ValidationError, match="stream_options can only be set when stream is true") as info:
        request_type(model="m", stream_options={"include_usage": True}, **fields)
    assert info.value.errors()[0]["loc"] == ("stream_options",)
    for quiet in ({}, None):  # vLLM's test is truthiness: empty options name nothing to stream
        assert request_type(model="m", stream_options=quiet, **fields).stream_options is not None or quiet is None
    streamed = request_type(model="m", stream=True, stream_options={"include_usage": True}, **fields)
    assert streamed.stream_options.include_usage


@pytest.mark.parametrize("key", ["\u00b2", "\u0663", "1\u00b2", "+1", " 1", "", "-"])
def test_logit_bias_keys_must_be_ascii_token_ids(key):
    # "²" and "٣" pass str.isdigit() but not int(): they must be a 400 here, not a 500 later.
    with pytest.raises(ValidationError, match="token ids"):
        CompletionRequest(model="m", prompt="a", logit_bias={key: 1.0})
    assert CompletionRequest(model="m", prompt="a", logit_bias={"-3": 1.0, "12": -1.0}).logit_bias


@pytest.mark.parametrize("endpoint,fields,param", [
    ("completions", {"suffix": "z"}, "suffix"),
    ("completions", {"best_of": 2}, "best_of"),
    ("completions", {"top_logprobs": 2}, "top_logprobs"),
    ("completions", {"prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
    ("completions", {"prompt_logprobs": 0, "stream": True}, "prompt_logprobs"),
    ("chat", {"echo": True}, "echo"),
    ("chat", {"tools": [{"type": "function"}]}, "tools"),
    ("chat", {"tool_choice": "auto"}, "tool_choice"),
    ("completions", {"include_stop_str_in_output": True}, "include_stop_str_in_output"),
    ("completions", {"allowed_token_ids": [28]}, "allowed_token_ids"),
    ("chat", {"truncate_prompt_tokens": 3}, "truncate_prompt_tokens"),
    ("chat", {"skip_special_tokens": False}, "skip_special_tokens"),
    ("completions", {"bad_words": ["x"]}, "bad_words"),
])
def test_options_not_implemented_are_named(endpoint, fields, param):
    body = CompletionRequest(model="m", prompt="a", **fields) if endpoint == "completions" else \
        ChatCompletionRequest(model="m", messages=CHAT, **fields)
    assert body.unsupported_option()[0] == param


def test_supported_options_pass_and_map_to_engine_values():
    body = CompletionRequest(model="m", prompt="a", n=3, logprobs=2, echo=True, prompt_logprobs=0,
                             include_stop_str_in_output=False, skip_special_tokens=True)  # their defaults
    assert body.unsupported_option() is None
    assert body.logprobs_top() == 2 and body.prompt_logprobs_top() == 0
    assert CompletionRequest(model="m", prompt="a", echo=True, logprobs=4).prompt_logprobs_top() == 4
    chat = ChatCompletionRequest(model="m", messages=CHAT, logprobs=True, top_logprobs=5, n=2)
    assert chat.unsupported_option() is None and chat.logprobs_top() == 5
    assert ChatCompletionRequest(model="m", messages=CHAT, logprobs=True).logprobs_top() == 0
    assert ChatCompletionRequest(model="m", messages=CHAT).logprobs_top() is None


def test_structured_outputs_from_every_spelling():
    def s(**fields):
        return ChatCompletionRequest(model="m", messages=CHAT, **fields).structured()

    schema = {"type": "object"}
    assert s() is None and s(response_format={"type": "text"}) is None
    assert s(response_format={"type": "json_object"}) == ("json_object", "")
    assert s(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}) == \
        ("json", '{"type": "object"}')
    assert s(structured_outputs={"regex": "a+"}) == ("regex", "a+")
    assert s(structured_outputs={"choice": ["y", "n"]}) == ("choice", '["y", "n"]')
    assert s(guided_json='{"type": "object"}') == ("json", '{"type": "object"}')
    assert s(guided_grammar="root ::= \"a\"") == ("grammar", "root ::= \"a\"")
    for bad, field in (({"response_format": {"type": "yaml"}}, "response_format"),
                       ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
                       ({"structured_outputs": {"lark": "x"}}, "structured_outputs"),
                       ({"structured_outputs": {"choice": []}}, "structured_outputs"),
                       ({"guided_json": "{not json"}, "guided_json"),
                       # a json_schema, or a schema, of the wrong JSON type: a 400, not a crash
                       ({"response_format": {"type": "json_schema", "json_schema": "x"}}, "response_format"),
                       ({"response_format": {"type": "json_schema", "json_schema": 5}}, "response_format"),
                       ({"response_format": {"type": "json_schema", "json_schema": [1]}}, "response_format"),
                       ({"guided_json": 5}, "guided_json"), ({"guided_json": "[1]"}, "guided_json"),
                       ({"structured_outputs": {"json": True}}, "structured_outputs"),
                       ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "structured_outputs")):
        with pytest.raises(ValueError) as info:
            s(**bad)
        assert str(info.value).startswith(field + ":")


# -- wire --------------------------------------------------------------------------------------------

def test_logprobs_cost_nothing_on_the_wire_when_not_asked():
    assert ENCODER.encode(GenerateChunk([5], finish_reason="length")) == b'{"token_ids":[5],"finish_reason":"length"}'
    chunk = GenerateChunk([5], logprobs=[[(5, -0.5, 1), (7, -1.5, 2)]])
    back = msgspec.json.decode(ENCODER.encode(chunk), type=GenerateChunk)
    assert back.logprobs == [[(5, -0.5, 1), (7, -1.5, 2)]]


def test_engine_positions_keep_vllms_order_and_clamp_minus_infinity():
    from collections import namedtuple

    from mooncake.engine.engine import position_logprobs

    lp = namedtuple("Logprob", "logprob rank decoded_token")
    position = {9: lp(-2.0, 3, None), 1: lp(-0.1, 1, None), 4: lp(float("-inf"), 2, None)}
    assert position_logprobs(position) == [(9, -2.0, 3), (1, -0.1, 1), (4, -9999.0, 2)]


# -- bodies ------------------------------------------------------------------------------------------

def test_completion_logprobs_list_k_plus_one_entries_and_continue_offsets():
    text = TokenText(LetterTokenizer())
    lp = CompletionLogprobs(1, text)
    first = lp.body([2, 0], [None, [(0, -0.2, 2), (1, -0.1, 1), (3, -3.0, 3)]])
    assert first == {"text_offset": [0, 1], "tokens": ["c", "a"], "token_logprobs": [None, -0.2],
                     "top_logprobs": [None, {"a": -0.2, "b": -0.1}]}
    assert lp.body([1], [[(1, -0.3, 1)]])["text_offset"] == [2]


def test_chat_logprobs_list_k_entries_with_bytes():
    content = chat_content([0], [[(0, -0.2, 1), (1, -1.1, 2)]], 1, TokenText(LetterTokenizer()))
    assert content == [{"token": "a", "logprob": -0.2, "bytes": [97],
                        "top_logprobs": [{"token": "a", "logprob": -0.2, "bytes": [97]}]}]
    assert chat_content([0], [[(0, -0.2, 1)]], 0, TokenText(LetterTokenizer()))[0]["top_logprobs"] == []


def test_prompt_logprobs_body_is_vllms():
    body = prompt_logprobs_body([None, [(1, -0.5, 2), (0, -0.1, 1)]], TokenText(LetterTokenizer()))
    assert body == [None, {"1": {"logprob": -0.5, "rank": 2, "decoded_token": "b"},
                           "0": {"logprob": -0.1, "rank": 1, "decoded_token": "a"}}]


def test_a_choice_echoes_cuts_at_stop_strings_and_keeps_logprobs():
    wanted = LogprobsWanted(chat=False, top=0, text=TokenText(LetterTokenizer()))
    choice = Choice(1, LetterTokenizer(), ["cd"], wanted, Echo("xy", [23, 24]))
    prompt = [None, [(24, -1.0, 1)]]
    first = choice.push(GenerateChunk([1, 2], logprobs=[[(1, -0.1, 1)], [(2, -0.2, 1)]]), prompt)
    assert first.index == 1 and first.text == "xyb" and first.finish is None  # "c" held: it may start "cd"
    assert first.logprobs["tokens"] == ["x", "y", "b", "c"] and first.logprobs["token_logprobs"][0] is None
    last = choice.push(GenerateChunk([3, 4], logprobs=[[(3, -0.3, 1)], [(4, -0.4, 1)]]), prompt)
    assert last.text == "" and last.finish == "stop" and choice.done and choice.text == "xyb"
    # "d" (token 3) completed the stop: token 4 came in the same chunk but is not the answer's (vLLM
    # checks stop strings after every step and would not have generated it).
    assert choice.count == 3 and choice.logprobs["token_logprobs"] == [None, -1.0, -0.1, -0.2, -0.3]
    assert choice.push(GenerateChunk([5], finish_reason="length"), prompt) is None


def test_a_choice_names_what_stopped_it_as_vllms_stop_reason():
    by_string = Choice(0, LetterTokenizer(), ["cd"])
    by_string.push(GenerateChunk([1, 2]), [])
    event = by_string.push(GenerateChunk([3, 4]), [])
    assert (event.finish, event.stop_reason, by_string.stop_reason) == ("stop", "cd", "cd")
    by_token = Choice(0, LetterTokenizer(), ["zz"])
    assert by_token.push(GenerateChunk([0, 1]), []).stop_reason is None  # not finished yet
    event = by_token.push(GenerateChunk([2, 7], finish_reason="stop", stop_reason=7), [])
    assert (event.finish, event.stop_reason, event.text) == ("stop", 7, "bc")  # the stop token's text left out
    assert by_token.count == 4 and by_token.text == "abc"
    eos = Choice(0, LetterTokenizer(), [])
    assert eos.push(GenerateChunk([1], finish_reason="stop"), []).stop_reason is None
    cut = Choice(0, LetterTokenizer(), [])
    assert cut.push(GenerateChunk([1], finish_reason="length"), []).stop_reason is None
    at_the_end = Choice(0, LetterTokenizer(), ["b"])  # the last token's text completes the stop string
    event = at_the_end.push(GenerateChunk([0, 1], finish_reason="length"), [])
    assert (event.text, event.finish, event.stop_reason) == ("a", "stop", "b")


def test_an_echo_alone_answers_the_prompt_and_drops_the_generated_token():
    wanted = LogprobsWanted(chat=False, top=0, text=TokenText(LetterTokenizer()))
    choice = Choice(0, LetterTokenizer(), [], wanted, Echo("xy", [23, 24], only=True))
    event = choice.push(GenerateChunk([1], logprobs=[[(1, -0.1, 1)]], finish_reason="length"), [None, [(24, -1.0, 1)]])
    assert event.text == "xy" and event.finish == "length" and choice.count == 0
    assert choice.logprobs["tokens"] == ["x", "y"] and choice.logprobs["token_logprobs"] == [None, -1.0]


def test_a_stop_string_cannot_end_a_choice_within_its_min_tokens():
    # Tokens 2, 3, 2, 3, 4 spell "cdcde": "d" completes at the 2nd token, but min_tokens=3 holds
    # stop checks until the 4th, whose "d" then stops it (vLLM's detokenizer rule).
    choice = Choice(0, LetterTokenizer(), ["d"], min_tokens=3)
    first = choice.push(GenerateChunk([2, 3]), [])
    assert first.text == "cd" and first.finish is None
    last = choice.push(GenerateChunk([2, 3, 4]), [])
    assert last.finish == "stop" and choice.text == "cdc" and choice.count == 4  # token 4 came after the stop
    eager = Choice(0, LetterTokenizer(), ["d"])
    assert eager.push(GenerateChunk([2, 3, 2, 3]), []).finish == "stop" and eager.text == "c"


# -- n samples ---------------------------------------------------------------------------------------

class FakeWorkers:
    """Answers generate with tokens 1, 2, 3 (one per line, after a short pause), records every
    request, and when each started relative to the first decode line."""

    def __init__(self):
        self.requests = []
        self.decoding = False  # sample 0's decode stream has yielded a line
        self.started_before_decoding = []
        self.closed = 0

    async def generate(self, worker, request):
        self.requests.append((worker.name, request))
        if "-s" in request.request_id:
            self.started_before_decoding.append(not self.decoding)
        tokens = [7] if request.sampling.max_tokens == 1 else [1, 2, 3]
        try:
            for i, token in enumerate(tokens):
                await asyncio.sleep(0.01)
                if request.request_id == "r-d1":
                    self.decoding = True
                last = i == len(tokens) - 1
                yield GenerateChunk([token], finish_reason="length" if last else None,
                                    num_cached_tokens=300 if i == 0 else None)
        finally:
            self.closed += 1

    async def drop_transfer(self, worker, transfer_id):
        pass


def handle(name):
    h = WorkerHandle(http_url=f"http://{name}", instance_id=name, kv_address=f"{name}:1")
    return h


def test_n_samples_prefill_once_and_siblings_wait_for_the_decode_worker():
    async def main():
        workers = FakeWorkers()
        relay = Relay(workers, 5.0, lambda tried: None)
        route = Route(handle("p"), handle("d"))
        stats = RelayStats()
        sampling = Sampling(max_tokens=4, seed=10, prompt_logprobs=1)
        seen = [item async for item in relay.samples("r", [5] * 300, sampling, route, stats, 3)]
        names = [r.request_id for _, r in workers.requests]
        assert names.count("r-p") == 1 and sorted(names) == ["r-d1", "r-p", "r-s1-d1", "r-s2-d1"]
        assert workers.started_before_decoding == [False, False]
        for worker, request in workers.requests:
            if "-s" in request.request_id:
                index = int(request.request_id.split("-s")[1][0])
                assert worker == route.decode.name and request.prompt_token_ids == [5] * 300
                assert request.kv_transfer_params == {} and request.sampling.seed == 10 + index
                assert request.sampling.prompt_logprobs is None
        by_index = {i: [t for j, c in seen if j == i for t in c.token_ids] for i in range(3)}
        # Seeded: the decode worker samples sample 0's first token too (P's 7 is dropped).
        assert by_index == {0: [1, 2, 3], 1: [1, 2, 3], 2: [1, 2, 3]}
        assert stats.sibling_cached_tokens == [300, 300]
    asyncio.run(main())


def test_closing_the_n_samples_stream_closes_every_worker_stream():
    async def main():
        workers = FakeWorkers()
        relay = Relay(workers, 5.0, lambda tried: None)
        stream = relay.samples("r", [5] * 10, Sampling(max_tokens=40), Route(handle("p"), handle("d")),
                               RelayStats(), 3)
        got = 0
        async for _ in stream:
            got += 1
            if got == 4:
                break
        await stream.aclose()
        assert workers.closed == len(workers.requests)
    asyncio.run(main())


def test_with_a_grammar_the_decode_worker_samples_every_token_from_the_loaded_prompt():
    async def main():
        workers = FakeWorkers()
        relay = Relay(workers, 5.0, lambda tried: None)
        sampling = Sampling(max_tokens=4, structured=("regex", "[0-9]+"), prompt_logprobs=0)
        chunks = [c async for c in relay.run("r", [5] * 20, sampling, Route(handle("p"), handle("d")), RelayStats())]
        (_, prefill), (_, decode) = workers.requests
        assert prefill.sampling.structured is None and prefill.kv_transfer_params["mooncake_push"]["num_tokens"] == 20
        assert decode.sampling.structured == ("regex", "[0-9]+") and decode.prompt_token_ids == [5] * 20
        assert decode.kv_transfer_params["mooncake_pull"]["num_tokens"] == 20 and decode.sampling.max_tokens == 4
        assert decode.sampling.prompt_logprobs is None
        assert [t for c in chunks for t in c.token_ids] == [1, 2, 3]  # P's token (7) is not part of the answer
    asyncio.run(main())


# -- a request the engine refuses -------------------------------------------------------------------

class EngineGenerateError(Exception):
    """Named as vLLM's: AsyncLLM.generate wraps a ValueError from its validation in one."""


def refusing_worker_app(monkeypatch, seen: list):
    """The worker's real HTTP app whose engine refuses any structured request as vLLM does (an
    invalid regex), and streams one token for any other."""
    import mooncake.engine.app as worker_app
    from mooncake.control import ControlEndpoint
    from mooncake.engine.config import WorkerConfig

    async def fake_run_request(engine, request, overlap=None):
        seen.append(request.request_id)
        if request.sampling.structured is not None:
            raise EngineGenerateError() from ValueError("Failed to transform regex into a grammar: (")
        if request.sampling.seed == 99:
            raise RuntimeError("the engine broke")
        yield GenerateChunk([7], finish_reason="length")

    monkeypatch.setattr(worker_app, "run_request", fake_run_request)
    app = worker_app.create_app(WorkerConfig(role="both", model="m", served_model_name="m"), 1, 2,
                                ControlEndpoint("/nonexistent/connector.sock", "00" * 16))
    class Engine:
        async def abort(self, request_id):
            pass

    app.state.worker.engine = Engine()
    return app


def test_a_request_the_engine_refuses_is_a_400_tried_on_no_other_worker(monkeypatch):
    import httpx

    from conductor.errors import APIError
    from conductor.relay import Relay
    from conductor.workers import WorkerClient
    from tests.spine.test_lifecycle import PROMPT, make_service

    async def main():
        seen: list = []
        client = WorkerClient(token_timeout_s=5.0)
        await client._http.aclose()
        client._http = httpx.AsyncClient(transport=httpx.ASGITransport(app=refusing_worker_app(monkeypatch, seen)))
        pool = []
        relay = Relay(client, 5.0, lambda tried: next((h for h in pool if h.name not in tried), None))
        service = make_service(relay, (("p1", "prefill"), ("p2", "prefill"), ("d1", "decode"), ("d2", "decode")))
        pool.extend(service.router.pool.all())
        body = CompletionRequest(model="m", prompt=PROMPT, max_tokens=4, guided_regex="(")
        with pytest.raises(APIError) as info:
            await service.serve(await service.prepare(body), "completions")
        assert info.value.status == 400 and info.value.code == "invalid_value", info.value.body()
        assert "Failed to transform regex" in info.value.message
        assert len(seen) == 2 and seen[0].endswith("-p") and seen[1].endswith("-d1"), seen  # no retry
        assert service.snapshot()["in_flight"] == 0
        # Any other failure before the first token is still the worker's: retried, then a 503.
        seen.clear()
        body = CompletionRequest(model="m", prompt=PROMPT, max_tokens=4, seed=99)
        with pytest.raises(APIError) as info:
            await service.serve(await service.prepare(body), "completions")
        assert info.value.status == 503 and len(seen) > 2, seen
        await client.close()
    asyncio.run(main())


def test_max_tokens_null_and_beyond_the_room_left_are_served_as_vllm_does():
    asyncio.run(_max_tokens_null_and_beyond_the_room_left())


async def _max_tokens_null_and_beyond_the_room_left():
    """null on a completion is 16 tokens (OpenAI's and vLLM's default), not the whole context;
    a max_tokens that fits the context alone but not after the prompt is cut to the room left;
    only one beyond the context itself is a 400."""
    from tests.spine.test_lifecycle import PROMPT, ScriptedRelay, make_service

    service = make_service(ScriptedRelay([1]))
    limit = service.config.max_model_len
    null = await service.prepare(CompletionRequest(model="m", prompt=PROMPT, max_tokens=None))
    assert null.sampling.max_tokens == 16
    big = await service.prepare(CompletionRequest(model="m", prompt=PROMPT, max_tokens=limit - 10))
    assert big.sampling.max_tokens == limit - len(PROMPT)
    with pytest.raises(APIError) as info:
        await service.prepare(CompletionRequest(model="m", prompt=PROMPT, max_tokens=limit + 1))
    assert info.value.status == 400 and info.value.code == "context_length_exceeded"
    # vLLM's rule too: usage on every chunk only along with the final usage chunk
    for options, every_chunk in (({"continuous_usage_stats": True}, False),
                                 ({"continuous_usage_stats": True, "include_usage": True}, True)):
        req = await service.prepare(CompletionRequest(model="m", prompt=PROMPT, stream=True, stream_options=options))
        assert req.continuous_usage is every_chunk


def test_text_parts_of_a_message_are_joined_by_newlines_as_vllm_renders_them():
    from conductor.schemas import ChatMessage

    message = ChatMessage(role="user", content=[{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}])
    assert message.text() == "Hello\nworld"


def test_sampling_that_needs_every_generated_token_is_sampled_whole_on_the_decode_worker():
    from mooncake.protocol import Sampling

    assert not Sampling(max_tokens=4).first_token_on_decode()
    assert not Sampling(max_tokens=4, temperature=0.0, seed=3).first_token_on_decode()  # greedy: no draws
    assert not Sampling(max_tokens=4, repetition_penalty=1.3).first_token_on_decode()  # prompt and output alike
    for changed in ({"frequency_penalty": 0.5}, {"presence_penalty": -0.5}, {"seed": 3},
                    {"structured": ("regex", "a+")}):
        assert Sampling(max_tokens=4, **changed).first_token_on_decode(), changed
