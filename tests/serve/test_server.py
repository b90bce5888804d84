"""The server driven by the official openai SDK: every endpoint, streaming and not, chat and
completions, n, logprobs, structured outputs, errors (400 naming the field, 404, 503), /metrics.
Outputs are held to the offline Pipeline on the same checkpoint (greedy and seeded requests)."""

import json

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from servelab import Pipeline, SamplingParams  # noqa: E402
from servelab.serve.chat import CHATML_TEMPLATE  # noqa: E402
from servelab.serve.server import BackgroundServer  # noqa: E402

MODEL = "tiny"


def _pipe(path, **kw):
    return Pipeline.from_pretrained(path, block_size=4, num_blocks=256, max_model_len=256, **kw)


@pytest.fixture(scope="module")
def offline(tiny_path, one_torch_thread):
    return _pipe(tiny_path)


@pytest.fixture(scope="module")
def server(tiny_path, one_torch_thread):
    with BackgroundServer(_pipe(tiny_path), MODEL, chat_template=CHATML_TEMPLATE) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def _metrics(server):
    text = httpx.get(server.root + "/metrics").text
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_models_health_and_metrics_endpoints(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.root + "/health").status_code == 200
    metrics = _metrics(server)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", 'time_to_first_token_seconds_bucket{le="+Inf"}',
                 "inter_token_latency_seconds_count", "e2e_request_latency_seconds_sum"):
        assert "servelab:" + name in metrics


def test_completions_whole_and_streamed_equal_the_offline_pipeline(client, offline):
    prompt = "The cache line was evicted"
    expected = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert whole.choices[0].text == expected.text and whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == len(expected.prompt_token_ids) and whole.usage.completion_tokens == 8
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_n_and_a_list_of_prompts_give_prompt_major_choices(client, offline):
    prompts = ["abc", "The cache"]
    params = SamplingParams(n=3, seed=11, max_tokens=5, temperature=1.0, ignore_eos=True)
    expected = offline.generate(prompts, params)
    whole = client.completions.create(model=MODEL, prompt=prompts, n=3, seed=11, max_tokens=5, temperature=1.0,
                                      extra_body={"ignore_eos": True})
    assert [c.index for c in whole.choices] == list(range(6))
    assert [c.text for c in whole.choices] == [c.text for out in expected for c in out.outputs]
    streamed = {}
    for chunk in client.completions.create(model=MODEL, prompt=prompts, n=3, seed=11, max_tokens=5,
                                           temperature=1.0, stream=True, extra_body={"ignore_eos": True}):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(6)] == [c.text for c in whole.choices]


def test_chat_whole_and_streamed_with_text_parts_and_logprobs(client, offline):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
                {"role": "user", "content": [{"type": "text", "text": "more"}, {"type": "text", "text": "please"}]}]
    flat = [dict(m, content=m["content"] if isinstance(m["content"], str) else "more\nplease") for m in messages]
    expected = offline.chat(flat, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2),
                            chat_template=CHATML_TEMPLATE)[0]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=6, temperature=0,
                                           logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == expected.text
    assert len(choice.logprobs.content) == 6
    for entry, (sampled, *top) in zip(choice.logprobs.content, expected.logprobs):
        assert entry.logprob == pytest.approx(sampled[1], abs=1e-4) and entry.logprob <= 0
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx([lp for _, lp in top], abs=1e-4)
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy: the sampled is the top
    text, roles = "", []
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            roles += [c.delta.role] if c.delta.role else []
            text += c.delta.content or ""
    assert text == expected.text and roles == ["assistant"]


@pytest.mark.parametrize("response_format", [
    {"type": "json_schema", "json_schema": {"name": "c", "schema": {
        "type": "object", "properties": {"color": {"enum": ["red", "blue"]}}, "required": ["color"]}}},
    {"type": "json_object"},
])
def test_response_format_is_a_structured_output(client, response_format):
    pytest.importorskip("xgrammar")
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "json"}],
                                         max_tokens=40, temperature=0, response_format=response_format)
    choice = out.choices[0]
    if choice.finish_reason == "stop":  # a random model may spend its budget on whitespace: then a prefix
        value = json.loads(choice.message.content)
        assert isinstance(value, dict)
        if response_format["type"] == "json_schema":
            assert value["color"] in ("red", "blue")
    else:
        assert choice.message.content.lstrip().startswith("{")


@pytest.mark.parametrize("payload, param", [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "x", "top_k": 0}, "top_k"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "logprobs": 99}, "logprobs"),
    ({"prompt": "x " * 300}, "prompt"),
    ({"prompt": [10**6]}, "prompt"),
    ({"prompt": "x", "max_tokens": 256}, "max_tokens"),
    ({"prompt": "x", "response_format": {"type": "yaml"}}, "response_format.type"),
    ({"prompt": "x", "stop": [1, 2]}, "stop"),
    ({}, "prompt"),
])
def test_bad_requests_are_400_naming_the_field(server, payload, param):
    response = httpx.post(server.root + "/v1/completions", json={"model": MODEL, **payload})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_sdk_errors_malformed_json_unknown_model_and_content_parts(client, server):
    with pytest.raises(openai.NotFoundError, match="nope"):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], top_p=2)
    with pytest.raises(openai.BadRequestError, match="image_url"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}])
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "x"}])
    response = httpx.post(server.root + "/v1/chat/completions", content=b'{"messages": [',
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]


def test_full_engine_answers_503_and_queues_nothing(tiny_path, one_torch_thread):
    with BackgroundServer(_pipe(tiny_path), MODEL, max_waiting=2) as srv:
        response = httpx.post(srv.root + "/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 2})
        assert response.status_code == 503 and "max_waiting=2" in response.json()["error"]["message"]
        ok = httpx.post(srv.root + "/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
        pipe = srv.engine.pipeline
        assert pipe.kv_cache_manager.usage == 0.0 and not pipe._tracked


def test_logit_bias_stop_and_penalties_reach_the_sampler(client, offline):
    token = next(t for t in range(300, 512) if offline.tokenizer.decode([t]).strip().isalpha())
    forced = client.completions.create(model=MODEL, prompt="The cache", max_tokens=5, temperature=0,
                                       logit_bias={str(token): 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == offline.tokenizer.decode([token] * 5)
    expected = offline.generate(["The cache"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                              presence_penalty=1.5, frequency_penalty=0.5))[0]
    got = client.completions.create(model=MODEL, prompt="The cache", max_tokens=12, temperature=0,
                                    presence_penalty=1.5, frequency_penalty=0.5, extra_body={"ignore_eos": True})
    assert got.choices[0].text == expected.text
    stop = expected.text[3:5]
    if stop.strip():
        cut = client.completions.create(model=MODEL, prompt="The cache", max_tokens=12, temperature=0, stop=[stop],
                                        presence_penalty=1.5, frequency_penalty=0.5, extra_body={"ignore_eos": True})
        assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text
        assert expected.text.startswith(cut.choices[0].text)


def test_cli_refuses_a_bad_setting_with_status_2(tiny_path, capsys):
    from servelab.cli import main

    assert main(["serve", str(tiny_path), "--block-size", "abc"]) == 2
    assert "block_size" in capsys.readouterr().err
