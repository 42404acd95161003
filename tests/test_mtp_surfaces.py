"""MTP through every surface: `segcache generate --mtp`, the request engine (one row and
batched, cold and resumed from the prefix store), `segcache serve --mtp`: greedy text the
same as mlx-lm's, the prefill's hidden states feeding the head (no second prefill), and
the per-request log line's MTP acceptance."""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx is imported)

import json
import logging

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten

from segcache import open_store
from segcache.mtp import MTPHead, save_head
from segcache.mtp import drafter as mtp_drafter
from segcache.serve.engine import Chunk, Engine, Finish, GenRequest
from segcache.serve.worker import Job, Scheduler
from segcache.testing import models
from segcache.testing import tokenizer as test_tokenizer
from serve_util import TARGET, Server
from test_generate_cli import PROMPT, parse

CODE = open(TARGET.parent / "heldout_stdlib.txt").read()[2000:3000]


def random_head(model, seed=1):
    mx.random.seed(seed)
    head = MTPHead.build(model)
    mx.eval(head.module.parameters())
    return head


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny qwen3_next as an mlx-lm model directory, with a head file (mtp.safetensors)."""
    directory = tmp_path_factory.mktemp("mtp") / "model"
    directory.mkdir()
    model = models.build("qwen3_next")
    mx.save_safetensors(str(directory / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (directory / "config.json").write_text(json.dumps(models.config("qwen3_next")))
    test_tokenizer.save(directory)
    loaded, _ = mlx_lm.load(str(directory))
    save_head(random_head(loaded), directory / "mtp.safetensors")
    return directory


def cli(argv, capsys):
    from segcache import cli_generate

    code = cli_generate.run(parse(argv))
    return code, capsys.readouterr()


def test_cli_generate_mtp_matches_mlx_lm(tiny_dir, capsys, tmp_path):
    model, tokenizer = mlx_lm.load(str(tiny_dir))
    expected = mlx_lm.generate(model, tokenizer, PROMPT, max_tokens=15)
    base = ["generate", "--model", str(tiny_dir), "--prompt", PROMPT, "--max-tokens", "15", "--verbose", "False"]
    code, out = cli(base + ["--mtp", "--num-draft-tokens", "2"], capsys)
    assert code == 0, out.err
    assert out.out == expected + "\n"
    code, out = cli(base + ["--mtp", "--mtp-weights", str(tiny_dir / "mtp.safetensors"), "--verbose"], capsys)
    assert code == 0 and expected in out.out and "Speculative (mtp)" in out.out
    # errors: no head in the directory, --mtp-weights alone, a family without a head
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        if (tiny_dir / name).exists():
            (bare / name).symlink_to(tiny_dir / name)
    code, out = cli(["generate", "--model", str(bare), "--prompt", "x", "--mtp"], capsys)
    assert code == 1 and "segcache mtp extract" in out.err
    code, out = cli(base + ["--mtp-weights", str(tiny_dir / "mtp.safetensors")], capsys)
    assert code == 2 and "--mtp-weights needs --mtp" in out.err
    with pytest.raises(SystemExit):
        parse(base + ["--mtp", "--prompt-lookup"])


@pytest.fixture(scope="module")
def target():
    model, tok = mlx_lm.load(str(TARGET))
    return model, tok, random_head(model)


def serve(target, requests, *, concurrency, mtp=True, store=None):
    model, tok, head = target
    engine = Engine(model, tok, store=store, decode_concurrency=concurrency, num_draft_tokens=3,
                    mtp=head if mtp else None)
    sched = Scheduler(engine, max_queue=len(requests), max_running=concurrency, begin_step=engine.begin_step)
    events = {r.id: [] for r in requests}
    for r in requests:
        sched.submit(Job(r, events[r.id].append))
    for _ in range(5000):
        if not sched.step():
            break
    assert not sched.pending() and len(engine.decoder) == 0
    for ev in events.values():
        assert isinstance(ev[-1], Finish)
    return {rid: "".join(e.text for e in ev if isinstance(e, Chunk)) for rid, ev in events.items()}


@pytest.mark.parametrize("concurrency", (1, 3))
def test_engine_mtp_equals_plain_and_feeds_the_head_from_the_prefill(target, concurrency, monkeypatch, caplog,
                                                                      tmp_path):
    tok = target[1]
    prompts = [tok.encode(CODE[i * 300 : i * 300 + 250]) for i in range(3)]
    reqs = lambda tag: [GenRequest(f"{tag}{i}", p, 24) for i, p in enumerate(prompts)]  # noqa: E731
    plain = serve(target, reqs("r"), concurrency=concurrency, mtp=False)
    recomputed = []
    real = mtp_drafter.MTP._hidden_of
    monkeypatch.setattr(mtp_drafter.MTP, "_hidden_of", lambda self, ids: recomputed.append(len(ids)) or real(self, ids))
    with caplog.at_level(logging.INFO, logger="segcache.serve"):
        got = serve(target, reqs("r"), concurrency=concurrency)
    assert got == plain
    assert recomputed == []  # every prompt position's hidden state came from its prefill
    assert sum("mtp accepted" in r.getMessage() for r in caplog.records) == len(prompts)
    # resumed from the prefix store: the head's pages and boundary state come back with the target's
    # (store/drafter_records.py), the rest is collected: nothing is recomputed
    store = open_store(tmp_path / "store")
    try:
        serve(target, reqs("a"), concurrency=concurrency, store=store)
        recomputed.clear()
        again = [GenRequest(f"b{i}", p + tok.encode("\n# done\n"), 24) for i, p in enumerate(prompts)]
        want = serve(target, again, concurrency=concurrency, mtp=False)
        assert serve(target, again, concurrency=concurrency, store=store) == want
        assert recomputed == []
    finally:
        store.close()


def test_serve_mtp(tmp_path, target):
    """`segcache serve --mtp` on the shipped target with a head file next to it: mlx-lm's text,
    and the log line's acceptance."""
    model_dir = tmp_path / "target"
    model_dir.mkdir()
    for f in TARGET.iterdir():
        if f.name not in ("mtp.safetensors", "mtp_train.json"):  # the test's own head goes there
            (model_dir / f.name).symlink_to(f)
    save_head(target[2], model_dir / "mtp.safetensors")
    srv = Server(tmp_path / "store", "--mtp", "--num-draft-tokens", "2", model=model_dir,
                 log_path=tmp_path / "serve.log").start()
    try:
        want = mlx_lm.generate(target[0], target[1], prompt=target[1].encode(CODE), max_tokens=32)
        r = srv.client().completions.create(model="target", prompt=CODE, max_tokens=32)
        assert r.choices[0].text == want
        assert "mtp accepted" in srv.log()
    finally:
        srv.stop()


@pytest.mark.skipif(not (TARGET / "mtp.safetensors").exists(), reason="the shipped target has no MTP head")
def test_cli_generate_mtp_on_the_shipped_target(capsys):
    """The shipped head through `segcache generate --mtp`: mlx-lm's text, drafts accepted."""
    model, tokenizer = mlx_lm.load(str(TARGET))
    expected = mlx_lm.generate(model, tokenizer, CODE[:400], max_tokens=40)
    base = ["generate", "--model", str(TARGET), "--prompt", CODE[:400], "--max-tokens", "40", "--mtp",
            "--verbose", "False"]
    code, out = cli(base + ["--num-draft-tokens", "2"], capsys)
    assert code == 0, out.err
    assert out.out == expected + "\n"
    code, out = cli(base + ["--verbose"], capsys)
    assert code == 0 and expected in out.out
    line = next(x for x in out.out.splitlines() if x.startswith("Speculative (mtp)"))
    assert " accepted 0 " not in line
