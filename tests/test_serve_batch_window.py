"""`segcache serve --decode-concurrency 4` on a sliding-window model (tiny gemma3_text, window 8):
concurrent clients in one batch, prompts and answers past the window, each answer equal to
the same request alone (mlx-lm's generate on the same model directory); a finished row's
published prefix resumes the next request."""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx loads)

import threading

import httpx
import mlx_lm
import pytest

from serve_util import Server, stream_completion
from test_generate_cli import write_model

PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(",
    "import os\nprint(os.getcwd())\n",
    "x = [i * i for i in range(10)]",
    "class a:\n    pass\n\nclass b(a):\n    def f(self):\n        return 1\n",
    "hello",
    "for i in range(3):\n    for j in range(4):\n        print(i, j)\n",
]
N = 30


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("models") / "gemma3", "gemma3_text", 0)


@pytest.mark.parametrize("drafting", ([], ["--prompt-lookup"]))
def test_concurrent_clients_on_a_window_model_each_as_alone(tmp_path, model_dir, drafting):
    model, tok = mlx_lm.load(model_dir)
    ref = [mlx_lm.generate(model, tok, prompt=tok.encode(p), max_tokens=N) for p in PROMPTS]
    assert any(len(tok.encode(p)) + len(r) > 2 * 8 for p, r in zip(PROMPTS, ref)), "past the window"
    srv = Server(tmp_path / "store", "--decode-concurrency", "4", "--prompt-concurrency", "2", *drafting,
                 model=model_dir, log_path=tmp_path / "serve.log").start()
    try:
        out = [None] * len(PROMPTS)
        threads = [threading.Thread(target=stream_completion, args=(srv.url, p, N, out, i)) for i, p in enumerate(PROMPTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not any(t.is_alive() for t in threads)
        assert out == ref, srv.log()[-2000:]
        # a row published at its end (to_runtime: the ring in temporal order) resumes a request alone
        # that extends it. A row that ended on its EOS is published with the EOS fed (the session's
        # one end-of-sequence rule: a chat's next turn closes the message with that token), so the
        # extension carries it. Its prompt runs past the published ids by more than the token whose
        # logits a prefill returns: a prompt that is the published ids and one token more needs the
        # logits at their end, which a publish of a finished row does not store (the prefill then
        # resumes at the prompt's own checkpoint, as it should), so it would test the store's logits
        # rule, not the row.
        *_, last = mlx_lm.stream_generate(model, tok, prompt=tok.encode(PROMPTS[3]), max_tokens=N)
        published = tok.encode(PROMPTS[3] + ref[3]) + ([last.token] if last.finish_reason == "stop" else [])
        prompt = published + tok.encode(" x = 1\n")
        assert len(prompt) > len(published) + 1
        want = mlx_lm.generate(model, tok, prompt=prompt, max_tokens=N)
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": prompt, "max_tokens": N}, timeout=300).json()
        assert r["choices"][0]["text"] == want
        if not drafting:  # every row ends where its client's text does, so to_runtime publishes it
            assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == len(published), srv.log()[-3000:]
    finally:
        srv.stop()
