"""`mtplx serve` on a DeepSeek-V3 family artifact: the openai client's chat completion comes
back rendered through the model's own chat template, reasoning (the V3 fixture's generation
prompt opens `<think>`) apart from content, the same tokens as the engine generates for the
template's prompt."""

import argparse

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("uvloop")
pytest.importorskip("jinja2")
pytest.importorskip("tokenizers")

from test_server import TIMEOUT, _serve  # noqa: E402

from mtplx_runtime.artifact.build import build_artifact  # noqa: E402
from mtplx_runtime.cli.serve import add_args, api_key, build  # noqa: E402
from mtplx_runtime.engine.chat import parse_assistant, render_chat  # noqa: E402
from mtplx_runtime.engine.generate import generate  # noqa: E402
from mtplx_runtime.fixtures.tiny_deepseek import make_tiny_deepseek  # noqa: E402

MESSAGES = [{"role": "user", "content": "Which experts stay in the cache?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds-serve")
    src = make_tiny_deepseek(root / "src", "bf16", "v3").path
    build_artifact(src, root / "art", progress=False)
    parser = argparse.ArgumentParser()
    add_args(parser)
    args = parser.parse_args(["--model", str(root / "art"), "--dtype", "float32",
                              "--served-model-name", "ds", "--max-tokens", "10",
                              "--memory-budget", "600MiB"])
    app, engine, rt = build(args, api_key(args))
    try:
        with _serve(app) as port:
            yield port, rt
    finally:
        engine.close()
        rt.close()


def test_chat_completion_through_the_template(served):
    port, rt = served
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                           max_retries=0, timeout=TIMEOUT)
    r = client.chat.completions.create(model="ds", messages=MESSAGES, max_tokens=10,
                                       temperature=0)
    tok = rt.tokenizer
    ids, _ = generate(rt.model, render_chat(tok, MESSAGES), max_tokens=10,
                      stop_ids=tok.stop_ids)
    want = parse_assistant(ids, tok)
    msg = r.choices[0].message
    assert msg.content == want["content"]
    assert msg.model_extra["reasoning_content"] == want["reasoning"] != ""
    assert r.usage.prompt_tokens == len(render_chat(tok, MESSAGES))
