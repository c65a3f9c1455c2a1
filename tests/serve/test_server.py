"""The OpenAI-compatible server answers the `openai` client: completions and chat, streamed and not,
8 concurrent requests batched continuously, and OpenAI-style errors for bad requests."""
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tierlm.hf.init import init_model
from tierlm.hf.presets import make_config
from tierlm.infer.batcher import Batcher, eos_ids_of
from tierlm.infer.engine import InferConfig, InferenceEngine
from tierlm.serve.server import make_app
from tierlm.hf.checks import load_tokenizer
from ..memory import held_now

MODEL = "tiny-chat"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import uvicorn

    root = tmp_path_factory.mktemp("serve")
    cfg = make_config("llama", None, {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "intermediate": 128,
                                      "vocab": 512, "max_positions": 256, "initializer_range": 0.3})
    d = init_model(root / "model", cfg, seed=1)
    tok = load_tokenizer(d)
    # One layer streams from the store: the server path covers the streamed mode too.
    eng = InferenceEngine(d, InferConfig(cpu_mem="1GiB", dtype="fp32", max_batch=4, max_seq_len=128,
                                         resident_layers=1, nvme_dir=str(root / "nvme")), library_rss=held_now())
    batcher = Batcher(eng, tok, eos_ids_of(tok, d))
    batcher.start()
    with socket.socket() as s:  # a free port on loopback
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(make_app(batcher, tok, MODEL), host="127.0.0.1", port=port,
                                        log_level="warning"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline and th.is_alive(), "server did not start"
        time.sleep(0.05)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
    yield client, port, batcher
    srv.should_exit = True
    th.join(timeout=10)
    batcher.stop()
    eng.close()


def test_models_lists_the_served_model(server):
    client, _, _ = server
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_greedy_usage_and_stream_agree(server):
    client, _, _ = server
    r = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=0)
    c = r.choices[0]
    assert r.object == "text_completion" and c.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == len("The quick brown fox".encode())  # byte-level tokenizer
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert c.finish_reason == "stop" or r.usage.completion_tokens == 12
    again = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=0)
    assert again.choices[0].text == c.text
    chunks = list(client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=12,
                                            temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == c.text
    assert chunks[-1].choices[0].finish_reason == c.finish_reason


def test_sampling_with_a_seed_is_reproducible(server):
    client, _, _ = server
    kw = dict(model=MODEL, prompt="Once upon", max_tokens=10, temperature=1.0, top_p=0.9, seed=7,
              extra_body={"top_k": 50})  # top_k: an extension the client passes through
    a = client.completions.create(**kw).choices[0].text
    assert client.completions.create(**kw).choices[0].text == a


def test_stop_string_ends_the_text_before_it(server):
    client, _, _ = server
    full = client.completions.create(model=MODEL, prompt="abc", max_tokens=30, temperature=0).choices[0].text
    if len(full) < 6:
        pytest.skip("the random model ended too early to pick a stop string")
    stop = full[3:5]
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=30, temperature=0, stop=[stop])
    assert r.choices[0].text == full[: full.find(stop)] and r.choices[0].finish_reason == "stop"


def test_chat_with_template_streamed_and_not(server):
    client, _, _ = server
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    # ChatML: <|im_start|>role\ncontent<|im_end|>\n per message, then <|im_start|>assistant\n
    assert r.usage.prompt_tokens == 3 + 2 + len("system\nBe brief.\nuser\nHello!\nassistant\n".encode())
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_eight_concurrent_requests_match_their_solo_answers(server):
    client, _, batcher = server
    prompts = [f"request number {i}:" for i in range(8)]
    solo = [client.completions.create(model=MODEL, prompt=p, max_tokens=6 + i, temperature=0).choices[0].text
            for i, p in enumerate(prompts)]
    steps0 = batcher.stats.steps["decode"] + batcher.stats.steps["prefill"]

    def one(i):
        if i % 2:
            chunks = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=6 + i, temperature=0,
                                               stream=True)
            return "".join(c.choices[0].text for c in chunks)
        return client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=6 + i,
                                         temperature=0).choices[0].text
    with ThreadPoolExecutor(8) as ex:
        together = list(ex.map(one, range(8)))
    assert together == solo
    steps = batcher.stats.steps["decode"] + batcher.stats.steps["prefill"] - steps0
    assert steps < sum(len(p.encode()) + 6 + i for i, p in enumerate(prompts))  # steps were shared


@pytest.mark.parametrize("kw, status, param", [
    (dict(prompt="hi", temperature=5), 400, "temperature"),
    (dict(prompt="hi", max_tokens=0), 400, "max_tokens"),
    (dict(prompt="hi", max_tokens=10_000), 400, "max_tokens"),
    (dict(prompt="hi", n=2), 400, "n"),
    (dict(prompt=[1, 2, 99999]), 400, "prompt"),
    (dict(prompt=""), 400, "prompt"),
    (dict(prompt="hi", model="gpt-4"), 404, "model"),
])
def test_bad_completion_requests_get_openai_errors(server, kw, status, param):
    client, _, _ = server
    kw = {"model": MODEL, **kw}
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(**kw)
    assert e.value.status_code == status
    body = e.value.body
    err = body.get("error", body) if isinstance(body, dict) else {}
    assert err.get("message") and param in (err.get("param") or "")


def _post(url, body: bytes):
    """A raw POST (the client library would refuse to send these bodies); -> (status, json)."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_malformed_bodies_are_400_and_the_server_keeps_serving(server):
    client, port, _ = server
    base = f"http://127.0.0.1:{port}/v1"
    status, body = _post(base + "/completions", b"{not json")
    assert status == 400 and "error" in body
    status, body = _post(base + "/chat/completions", json.dumps({"model": MODEL, "messages": []}).encode())
    assert status == 400 and body["error"]["param"] == "messages"
    bad_role = {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}
    assert _post(base + "/chat/completions", json.dumps(bad_role).encode())[0] == 400
    status, body = _post(base + "/completions", json.dumps({"model": MODEL}).encode())
    assert status == 400 and body["error"]["param"] == "prompt"
    assert client.completions.create(model=MODEL, prompt="still up?", max_tokens=2).usage.completion_tokens >= 0
