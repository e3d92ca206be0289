"""Structured outputs and logit changes through a real server and the official `openai` client.

Shares its server with test_server_openai.py (same flags). Outputs are checked independently: the
client's pydantic parsing, `json`, `re.fullmatch`."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from reliability_support import wait_idle

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Describe a person as JSON: name, age, city."}]


class Person(BaseModel):
    name: str = Field(max_length=30)
    age: int = Field(ge=0, le=120)
    city: str = Field(max_length=30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_parse_with_a_pydantic_model(client):
    """The client's structured-output helper at temperature 1.0: every answer parses into the model."""
    def ask(seed: int):
        return client.beta.chat.completions.parse(model=MODEL, messages=ASK, response_format=Person,
                                                  temperature=1.0, seed=seed, max_tokens=120)
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(ask, range(8)))
    for r in results:
        choice = r.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Person), choice.message.content


def test_json_schema_streamed_and_json_object(client, server):
    schema = Person.model_json_schema()
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, temperature=0, max_tokens=120, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    Person.model_validate_json(text)
    r = client.chat.completions.create(model=MODEL, messages=ASK, temperature=1.0, seed=4, max_tokens=120,
                                       response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)


def test_vllm_fields_in_extra_body(client):
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Is water wet?"}],
                                          temperature=1.0, seed=1, max_tokens=5,
                                          extra_body={"guided_choice": ["yes", "no"]})
    assert chat.choices[0].message.content in ("yes", "no")
    done = client.completions.create(model=MODEL, prompt="My phone number is", temperature=1.0, seed=2, max_tokens=20,
                                     extra_body={"structured_outputs": {"regex": r" \d{3}-\d{4}"}})
    assert re.fullmatch(r" \d{3}-\d{4}", done.choices[0].text) and done.choices[0].finish_reason == "stop"
    gram = client.completions.create(model=MODEL, prompt="Colours:", temperature=0, max_tokens=20,
                                     extra_body={"guided_grammar": 'root ::= " " c ", " c\nc ::= "red" | "blue"'})
    assert re.fullmatch(r" (red|blue), (red|blue)", gram.choices[0].text)


def test_logit_bias_through_the_api(client):
    tokens = httpx.post(str(client.base_url).replace("/v1/", "/tokenize"),
                        json={"prompt": " banana", "add_special_tokens": False}, timeout=30).json()["tokens"]
    r = client.completions.create(model=MODEL, prompt="Hello", temperature=1.0, max_tokens=3,
                                  logit_bias={str(tokens[0]): 100})
    assert r.choices[0].text == " banana" * 3


@pytest.mark.parametrize("body,param,reason", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "fancy"}}}},
     "response_format", 'Unsupported type "fancy"'),
    ({"guided_regex": "(ab"}, "guided_regex", "parenthesis"),
    ({"structured_outputs": {"grammar": "root ::= nothing"}}, "structured_outputs", 'Rule "nothing" is not defined'),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice", "several"),
    ({"response_format": {"type": "xml"}}, "response_format", "not supported"),
    ({"logit_bias": {"999999": 5}}, "logit_bias", "outside the vocabulary"),
    ({"logit_bias": {"1": 500}}, "logit_bias", "[-100, 100]"),
    ({"allowed_token_ids": [10 ** 7]}, "allowed_token_ids", "outside the vocabulary"),
])
def test_invalid_constraints_and_ids_are_400_with_the_reason(server, body, param, reason):
    for path, base in (("/v1/chat/completions", {"messages": ASK}), ("/v1/completions", {"prompt": "Hi"})):
        r = httpx.post(server.url + path, json={"model": MODEL, "max_tokens": 4, **base, **body}, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and reason in err["message"], err


def test_server_is_idle_afterwards(server):
    wait_idle(server.url, timeout=60)
