"""The web page shows a reasoning model's reasoning apart from its answer: in a real headless
Chromium (as `test_web_page`), against a live `tandem serve` of a random-weight Qwen3-layout
model whose template opens `<think>`. The page's streamed reply puts the server's
`reasoning_content` in a collapsible block and the `content` in the answer, equal to what the
API returns for the same greedy request; the block is folded once the answer starts.

The random model needs steering to close its reasoning (`test_serve_reasoning.steering`); the
test adds those fields to the page's own request (a wrapper around `fetch`), the page's
script handles the stream unchanged."""

import json

import openai
import pytest
from reasoning_models import think_model
from serve_support import running
from test_serve_reasoning import steering
from test_web_page import _by_id, _send, _wait, browser  # noqa: F401 (the browser fixture)

QUESTION = "How do I open a file?"
MAX_TOKENS = 48
STEER = """
const steer = JSON.parse(arguments[0]);
const plain = window.fetch.bind(window);
window.fetch = (url, init) => {
  if (String(url).endsWith("/v1/chat/completions") && init && init.body)
    init = {...init, body: JSON.stringify({...JSON.parse(init.body), ...steer})};
  return plain(url, init);
};
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = think_model(tmp_path_factory.mktemp("think") / "qwen3-think")
    with running(["serve", "--model", str(model)]) as (_, base):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        yield base, client, client.models.list().data[0].id, steering(model, "</think>")


def test_the_page_shows_reasoning_in_a_folded_block_apart_from_the_answer(served, browser):  # noqa: F811
    base, client, name, steer = served
    want = (
        client.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": QUESTION}],
            temperature=0,
            max_tokens=MAX_TOKENS,
            **steer,
        )
        .choices[0]
        .message
    )
    assert want.reasoning_content and want.content  # the steering makes both
    browser.get(base + "/")
    _wait(browser, lambda d: _by_id(d, "main").is_displayed(), what="the page")
    _wait(browser, lambda d: _by_id(d, "model-name").text == name, what="the model's name")
    browser.execute_script(STEER, json.dumps(steer))
    _by_id(browser, "settings").click()
    for id_, value in (("temperature", "0"), ("max-tokens", str(MAX_TOKENS))):
        field = _by_id(browser, id_)
        field.clear()
        field.send_keys(value)
    reply = _send(browser, QUESTION)
    assert reply.get_attribute("data-state") == "done", _by_id(browser, "chat-error").text
    block = reply.find_element("css selector", "details.reasoning")
    assert block.is_displayed() and block.get_attribute("open") is None  # folded: the answer came
    text = block.find_element("css selector", ".reasoning-text")
    assert text.get_attribute("textContent") == want.reasoning_content
    answer = reply.find_element("css selector", ".text")
    assert answer.get_attribute("textContent") == want.content  # the reasoning is not in it
    block.find_element("css selector", "summary").click()  # unfolds on a click
    assert block.get_attribute("open") is not None and text.is_displayed()
