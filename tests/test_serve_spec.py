"""`segcache serve --draft-model` and `--prompt-lookup` on the hybrid target:
the same text as mlx-lm's plain greedy decoding, cold and resumed."""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx loads)

import functools

import mlx_lm
import pytest
from mlx_lm.server import convert_chat

from serve_util import DRAFT, TARGET, Server

CODE = open(TARGET.parent / "heldout_stdlib.txt").read()[2000:3200]


@pytest.fixture(scope="module")
def ref():
    return mlx_lm.load(str(TARGET))


@pytest.fixture(scope="module")
def greedy(ref):
    """mlx-lm's plain greedy text of (prompt ids, max_tokens), computed once for both servers."""
    @functools.lru_cache(maxsize=None)
    def text(ids: tuple, max_tokens: int) -> str:
        return mlx_lm.generate(*ref, prompt=list(ids), max_tokens=max_tokens)

    return text


FLAGS = [(("--draft-model", DRAFT), "draft"), (("--prompt-lookup",), "lookup"),
         (("--prompt-lookup", "--draft-tree", "8"), "lookup"),
         (("--draft-model", DRAFT, "--draft-tree", "12"), "draft")]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """One server per entry of FLAGS, each with a store of its own, launched together (ready:
    `wait_ready`), so that their start-ups share the cores with each other and with the
    reference loading here; each test talks to its own server only."""
    started = []
    try:
        for i, (flags, _) in enumerate(FLAGS):
            d = tmp_path_factory.mktemp(f"spec{i}")
            started.append(Server(d / "store", *flags, "--num-draft-tokens", "4", log_path=d / "serve.log").launch())
        yield started
    finally:
        for srv in started:
            srv.stop()


@pytest.mark.parametrize("flags, mode", FLAGS)
def test_speculative_serving_is_identical_to_plain(servers, ref, greedy, flags, mode):
    srv = servers[FLAGS.index((flags, mode))].wait_ready()
    client = srv.client()
    ids = ref[1].encode(CODE)
    want = greedy(tuple(ids), 64)
    for _ in range(2):  # cold, then resumed from the prefix cache
        r = client.completions.create(model="target", prompt=CODE, max_tokens=64)
        assert r.choices[0].text == want
    assert r.usage.prompt_tokens_details.cached_tokens == len(ids)  # whole: its end's logits too
    msgs = [{"role": "user", "content": CODE[:400]}]
    for q in ("def close(self):", "def flush(self):"):
        r = client.chat.completions.create(model="target", messages=msgs, max_tokens=48)
        got = r.choices[0].message.content
        assert got == greedy(tuple(ref[1].encode(convert_chat(msgs))), 48)
        msgs = msgs + [{"role": "assistant", "content": got}, {"role": "user", "content": q}]
    assert f"{mode} accepted" in srv.log()
