"""The official `ollama` client, unchanged, against a live `tandem serve` on the tiny model: list,
chat and generate streamed and not (greedy: the OpenAI route's text), `format` constraining the
answer to a schema (a bad one refused with Ollama's error), behind the API key."""

import json

import jsonschema
import ollama
import openai
import pytest
from serve_support import make_model, running

KEY = "right-key"
GREEDY = {"temperature": 0, "repeat_penalty": 1.0, "num_predict": 12}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_model(tmp_path_factory.mktemp("ollama") / "model")
    with running(["serve", "--model", str(model)], env={"TANDEM_API_KEY": KEY}) as (_, base):
        client = ollama.Client(host=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
        oa = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=120)
        yield client, oa


def test_list_names_the_served_model(server):
    client, oa = server
    (m,) = client.list().models
    assert m.model == f"{oa.models.list().data[0].id}:latest"


def test_chat_streamed_and_not_equals_the_openai_greedy_answer(server):
    client, oa = server
    name = client.list().models[0].model
    msgs = [{"role": "user", "content": "Once upon a time"}]
    want = (
        oa.chat.completions.create(
            model=oa.models.list().data[0].id, messages=msgs, temperature=0, max_tokens=12
        )
        .choices[0]
        .message.content
    )
    whole = client.chat(model=name, messages=msgs, options=GREEDY, stream=False)
    assert whole.message.content == want and whole.done and whole.eval_count >= 1
    parts = list(client.chat(model=name, messages=msgs, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == want and parts[-1].done


def test_generate_streamed_and_not_and_its_context_continues(server):
    client, _ = server
    name = client.list().models[0].model
    whole = client.generate(model=name, prompt="The quick brown fox", options=GREEDY, stream=False)
    parts = list(
        client.generate(model=name, prompt="The quick brown fox", options=GREEDY, stream=True)
    )
    assert "".join(p.response for p in parts) == whole.response and parts[-1].done
    assert list(parts[-1].context) == list(whole.context)
    more = client.generate(
        model=name, prompt=" and", raw=True, context=whole.context, options=GREEDY
    )
    assert more.done and len(more.context) > len(whole.context)


def test_format_constrains_the_answer_to_the_schema_and_a_bad_one_is_refused(server):
    client, _ = server
    name = client.list().models[0].model
    schema = {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
        "required": ["colour", "ok"],
        "additionalProperties": False,
    }
    msgs = [{"role": "user", "content": "hi"}]
    r = client.chat(model=name, messages=msgs, format=schema, options={"num_predict": 40})
    jsonschema.validate(json.loads(r.message.content), schema)
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=name, messages=msgs, format={"type": "no-such-type"})
    assert e.value.status_code == 400 and "format" in e.value.error


def test_the_ollama_routes_need_the_api_key(server):
    client, _ = server
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=str(client._client.base_url)).list()
    assert e.value.status_code == 401
