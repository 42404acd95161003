"""DFlash through the surfaces on the shipped target: `segcache generate --dflash` (and a
`--draft-model` that is a DFlash checkpoint, recognised from its config), the request engine
one row and batched, and `segcache serve --dflash`: greedy text the same as mlx-lm's."""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx is imported)

import mlx_lm
import pytest

from segcache.dflash import load_dflash
from segcache.generation import stream_generate
from segcache.serve.engine import Chunk, Engine, Finish, GenRequest
from segcache.serve.worker import Job, Scheduler
from segcache.testing.dflash import write_checkpoint
from serve_util import TARGET, Server
from test_generate_cli import parse

CODE = open(TARGET.parent / "heldout_stdlib.txt").read()[2000:3000]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    model, tok = mlx_lm.load(str(TARGET))
    path = write_checkpoint(model, tmp_path_factory.mktemp("dfl") / "drafter", seed=7, block_size=4)
    return model, tok, path


def cli(argv, capsys):
    from segcache import cli_generate

    code = cli_generate.run(parse(argv))
    return code, capsys.readouterr()


def assert_cli_generates(path, expected: str, capsys) -> list[str]:
    """`segcache generate` with the drafter at `path`, by --dflash and by --draft-model (which must
    say it took a DFlash drafter), prints `expected`; returns the command's common arguments."""
    base = ["generate", "--model", str(TARGET), "--prompt", CODE[:300], "--max-tokens", "16", "--verbose", "False"]
    code, out = cli(base + ["--dflash", str(path), "--block-size", "3"], capsys)
    assert code == 0, out.err
    assert out.out == expected + "\n"
    code, out = cli(base + ["--draft-model", str(path)], capsys)
    assert code == 0, out.err
    assert out.out == expected + "\n" and "is a DFlash drafter" in out.err
    return base


def test_cli_generate_dflash_matches_mlx_lm(target, capsys):
    model, tok, path = target
    expected = mlx_lm.generate(model, tok, CODE[:300], max_tokens=16)
    base = assert_cli_generates(path, expected, capsys)
    code, out = cli(base + ["--dflash", str(path), "--prompt-lookup"], capsys)  # both: per row the better
    assert code == 0, out.err
    assert out.out == expected + "\n"
    for other in (["--mtp"], ["--draft-model", str(TARGET)]):
        code, out = cli(base + ["--dflash", str(path)] + other, capsys)
        assert code == 2 and "--dflash drafts alone or beside --prompt-lookup" in out.err


@pytest.mark.parametrize("lookup", (False, True), ids=("dflash", "lookup+dflash"))
@pytest.mark.parametrize("concurrency", (1, 3))
def test_engine_dflash_equals_plain(target, concurrency, lookup):
    model, tok, path = target
    drafter = load_dflash(path, model)
    prompts = [tok.encode(CODE[i * 300 : i * 300 + 120 + 40 * i]) for i in range(3)]

    def serve(dflash):
        engine = Engine(model, tok, decode_concurrency=concurrency, dflash=dflash, prompt_lookup=lookup and dflash is not None)
        assert engine.decoder.mode == ("plain" if dflash is None else "lookup+dflash" if lookup else "dflash")
        sched = Scheduler(engine, max_queue=3, max_running=concurrency, begin_step=engine.begin_step)
        events = {i: [] for i in range(3)}
        for i, p in enumerate(prompts):
            sched.submit(Job(GenRequest(f"r{i}", p, 16), events[i].append))
        for _ in range(2000):
            if not sched.step():
                break
        assert all(isinstance(ev[-1], Finish) for ev in events.values())
        return {i: "".join(e.text for e in ev if isinstance(e, Chunk)) for i, ev in events.items()}

    assert serve(drafter) == serve(None)


def test_serve_dflash(tmp_path, target):
    model, tok, path = target
    srv = Server(tmp_path / "store", "--dflash", str(path), "--block-size", "4", model=TARGET,
                 log_path=tmp_path / "serve.log").start()
    try:
        want = mlx_lm.generate(model, tok, prompt=tok.encode(CODE[:400]), max_tokens=16)
        r = srv.client().completions.create(model="target", prompt=CODE[:400], max_tokens=16)
        assert r.choices[0].text == want
    finally:
        srv.stop()


def test_the_shipped_drafter_loads_and_drafts_what_the_target_accepts():
    """The drafter shipped beside the target (models/dflash, the published layout): greedy text
    equal to mlx-lm's on held-out code, with drafts accepted."""
    model, tok = mlx_lm.load(str(TARGET))
    drafter = load_dflash(TARGET.parent / "dflash", model)
    prompt = tok.encode(CODE[:400])
    want = mlx_lm.generate(model, tok, prompt=prompt, max_tokens=24)
    out = list(stream_generate(model, tok, prompt, max_tokens=24, dflash=drafter))
    assert "".join(r.text for r in out) == want
    assert sum(r.from_draft for r in out) > 0
