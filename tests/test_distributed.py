"""Two ranks over loopback (MLX's ring backend): sharded models, the lockstep primitives, stores per rank.

Each test starts both ranks of tests/dist_rank.py with `segcache.testing.ranks.run`
(what `mlx.launch --backend ring -n 2` does, on free ports, with a deadline; one
test goes through `mlx.launch` itself) and reads the `RESULT` lines they print.
The references are independent of the ranks' code paths: mlx-lm's own greedy
loop and caches on the unsharded model, computed in each rank.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

from segcache import Runtime, StoreError, open_store
from segcache.distributed import Channel, Shard, fingerprint, load, rank_path, shard_of
from segcache.distributed import lockstep as run_lockstep
from segcache.errors import BranchError, RankDivergedError, RankFailedError
from segcache.testing import lockstep, models, ranks

RANK = str(Path(__file__).with_name("dist_rank.py"))
CONFIGS = [("llama", "tensor"), ("qwen3_5", "tensor"), ("qwen3_5", "pipeline"), ("qwen3_next", "pipeline")]
TIMEOUT = 300  # seconds per launch; the ranks are killed past it (a loaded machine is slow, never hung)


def launch(*args, **kwargs) -> list[ranks.Rank]:
    out = ranks.run([RANK, *map(str, args)], timeout=kwargs.pop("timeout", TIMEOUT), **kwargs)
    for r in out:
        assert not r.killed or kwargs.get("grace") is not None, f"rank {r.rank} was killed at the deadline:\n{r.stderr[-3000:]}"
    return out


def ok(out: list[ranks.Rank]) -> list[ranks.Rank]:
    for r in out:
        assert r.returncode == 0, f"rank {r.rank} exited with {r.returncode}:\n{r.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("models")
    for family in ("llama", "qwen3_5", "qwen3_next"):
        lockstep.save_model(family, root / family)
    return root


@pytest.fixture(scope="module")
def sharded(model_dir) -> dict:
    """One launch: every family and mode, both ranks' results by (family, mode)."""
    out = ok(launch("models", model_dir))
    found = {}
    for r in out:
        for res in r.json():
            found.setdefault((res["family"], res["mode"]), []).append(res)
    return found


# -- sharded models ------------------------------------------------------------------


@pytest.mark.parametrize("family,mode", CONFIGS)
def test_shard_is_read_off_the_model(sharded, family, mode):
    a, b = sharded[(family, mode)]
    assert [a["shard"]["rank"], b["shard"]["rank"]] == [0, 1]
    assert a["shard"]["parallel"] == b["shard"]["parallel"] == mode
    if mode == "pipeline":  # rank 0 runs the last layers (mlx-lm's split), rank 1 the first
        assert a["shard"]["layers"] == [2, 4, 4] and b["shard"]["layers"] == [0, 2, 4]
    else:
        assert a["shard"]["layers"] == b["shard"]["layers"]


@pytest.mark.parametrize("family,mode", CONFIGS)
def test_programs_give_the_unsharded_logits(sharded, family, mode):
    """fork / forward / commit / rollback programs: every forward's logits against the same
    program on the unsharded model, and bitwise the same on both ranks."""
    for res in sharded[(family, mode)]:
        assert res["ranks_bitwise_equal"], res
        assert res["same_as_native"], res  # the committed state against mlx-lm's caches on the shard
        if mode == "pipeline":
            assert res["worst_abs"] == 0.0  # the same kernels on the same rows: bit for bit
        else:
            # Split reductions round differently: measured <= 7e-6 on logits of magnitude ~10.
            assert res["worst_abs"] < 1e-4, res
        assert res["chunked_abs"] < 1e-4, res  # the chunked GDN prefill on the rank's heads


@pytest.mark.parametrize("family,mode", CONFIGS)
def test_each_rank_holds_its_slice(sharded, family, mode):
    """After the programs, a rank's committed K/V, conv tails and GDN states are its slice of the
    unsharded runtime's (its layers; or its heads and conv channels): bit for bit under
    pipeline parallelism, within the split sums' rounding under tensor parallelism."""
    for res in sharded[(family, mode)]:
        if mode == "pipeline":
            assert res["worst_slice"] == 0.0, res
        else:
            assert res["worst_slice"] < 1e-4, res


@pytest.mark.parametrize("family,mode", CONFIGS)
def test_greedy_tokens_as_one_process(sharded, family, mode):
    """Plain and prompt-lookup decoding (rank 0 decides, the other replays; and segcache's
    own engine on each rank) give mlx-lm's greedy tokens of the unsharded model."""
    a, b = sharded[(family, mode)]
    assert a["reference"] == b["reference"]
    for res in (a, b):
        for key in ("plain", "lookup", "engine", "engine_lookup"):
            assert res[key] == res["reference"][: len(res[key])], (key, res)
        assert len(res["plain"]) == len(res["lookup"]) == 12
        assert res["held_ok"]  # the runtime holds prompt + tokens[:-1], no branch left open
    assert a["rounds"]["drafted"] > 0  # rank 0 drafted, and the branches were committed


def test_batched_decoder_on_the_shards(model_dir):
    """segcache's batched decoder (rows joining mid-generation, plain and prompt lookup) on
    both ranks, each deciding alone: every row's tokens are mlx-lm's greedy tokens of that
    prompt on the unsharded model, the same on both ranks."""
    out = ok(launch("batch", model_dir))
    runs = [res for r in out for res in r.json()]
    assert len(runs) == 2 * len(CONFIGS) * 2
    for res in runs:
        assert res["ranks_equal"], res
        assert res["got"] == res["want"], (res["family"], res["mode"], res["width"])


def test_lookup_rounds_commit_partially(sharded):
    """Some configuration's rounds accepted part of their drafts: commit(n) inside a branch ran."""
    assert any(res[0]["rounds"].get("partial", 0) for res in sharded.values())
    assert any(res[0]["rounds"].get("accepted", 0) for res in sharded.values())


# -- the primitives --------------------------------------------------------------------


def test_channel_messages():
    a, b = ok(launch("channel"))
    x, y = a.json()[0], b.json()[0]
    assert x["rows"] == y["rows"] == [[0, 1], [10, 11, 12, 13, 14, 15, 16]]  # rank 1's overflows the frame
    assert x["long"] == y["long"] == list(range(100))  # rank 0's words, whatever the others pass
    assert x["payload"] == y["payload"] == (bytes(range(256)) * 3 + b"end").hex()
    assert x["empty"] == y["empty"] == ""
    assert x["least"] == y["least"] == 7
    assert x["request"] == y["request"] == {"prompt": [1, 2, 3], "max_tokens": 5, "salt": "006b", "t": 0.5}
    assert x["same"] and y["same"]
    assert x["failed"] == y["failed"] == [1]
    assert not x["diverged"] and not y["diverged"]
    assert x["collectives"] == y["collectives"] and x["sent_bytes"] == y["sent_bytes"] > 0


def test_a_step_failing_on_one_rank_fails_on_every_rank(model_dir):
    """Rank 1 raises half-way through a forward (after its first layers built their graphs,
    collectives included): both ranks raise RankFailedError, both hold what they held before
    the step, nothing of it runs later (the next forward gives the unsharded model's logits
    for the held tokens), and the group goes on to generate mlx-lm's tokens."""
    a, b = ok(launch("fault", model_dir))
    for x, y in zip(a.json(), b.json()):
        assert "rank(s) [1] failed" in x["error"] and "rank(s) [1] failed" in y["error"]
        assert "Fault: injected" in y["error"]  # rank 1 names its own error
        assert x["held"] == y["held"] and x["held"]
        assert x["close"] and y["close"]
        assert x["again"] == y["again"] == x["reference"]


def test_a_lost_rank_stops_the_others(model_dir):
    """Rank 1 dies: rank 0 gets RankLostError at its next message, and does not hang."""
    a, b = launch("kill", model_dir, timeout=120, grace=60)
    assert b.returncode == 3
    res = a.json()
    assert a.returncode == 0 and res and res[0]["error"].startswith("RankLostError"), (a.stdout, a.stderr[-2000:])


def test_a_stuck_rank_ends_the_others_by_their_watchdog():
    """Rank 1 stays alive but stops taking part: rank 0's channel deadline ends it, saying why."""
    # rank 1 would sleep 60 s: once rank 0 has left, waiting longer for it proves nothing
    a, b = launch("stuck", timeout=120, grace=2)
    assert a.returncode == 75 and "another rank is gone or stuck" in a.stderr
    assert a.json() == [{"rank": 0, "waiting": True}]
    assert b.killed  # the test stopped it


def test_mlx_launch_runs_the_ranks(model_dir):
    """The same under `mlx.launch --backend ring -n 2` itself."""
    done = ranks.mlx_launch([RANK, "launch", str(model_dir)], timeout=TIMEOUT)  # our environment, PYTHONPATH included
    assert done.returncode == 0, done.stderr[-3000:]
    found = [json.loads(line.split("RESULT ", 1)[1]) for line in done.stdout.splitlines() if "RESULT " in line]
    assert sorted(r["rank"] for r in found) == [0, 1]
    assert all(r["size"] == 2 and r["shard"]["parallel"] == "tensor" for r in found)
    assert found[0]["tokens"] == found[1]["tokens"] and len(found[0]["tokens"]) == 6


# -- one rank, no group: what the primitives do alone ------------------------------------------


def test_single_process_channel_and_lockstep():
    """A group of one: no collective, the rank's own words back; lockstep undoes a failed build."""
    channel = Channel()
    assert channel.size == 1 and channel.leader
    assert channel.gather([1, 2]) == [[1, 2]] and channel.broadcast([3]) == [3] and channel.share(b"x") == b"x"
    with pytest.raises(ValueError):
        channel.gather([1 << 64])
    rt = Runtime(models.build("qwen3_5"))
    rt.forward([1, 2, 3])

    def half():
        rt.forward([5, 6])
        raise ValueError("boom")

    with pytest.raises(RankFailedError, match="boom"):
        run_lockstep(channel, half, [rt])
    assert rt.tokens == [1, 2, 3]
    rt.check()
    assert run_lockstep(channel, lambda: rt.forward([4]), [rt]).shape[1] == 1
    assert rt.tokens == [1, 2, 3, 4]
    verdict = channel.check(True, fingerprint([1, 2], "x"))
    assert verdict.ok and verdict.fingerprints == (fingerprint([1, 2], "x"),)
    assert isinstance(verdict.error("s", 0), RankDivergedError)


@pytest.mark.parametrize("family", ["qwen3_5", "gemma3_text", "llama", "falcon_h1"])
def test_savepoint_undo_restores_every_layer_kind(family):
    """undo after forwards (one evaluated, one left lazy) gives, bit for bit, the state of a
    runtime that never ran them; it is refused across a fork."""
    model = models.build(family)
    rt, ref = Runtime(model), Runtime(model)
    rt.forward(list(range(3, 14)))
    ref.forward(list(range(3, 14)))
    point = rt.savepoint()
    rt.forward([20, 21, 22])
    mx.eval(rt.forward([23])[0])
    rt.forward([24])
    rt.undo(point)
    rt.check()
    assert rt.tokens == ref.tokens
    assert mx.array_equal(rt.forward([30, 31])[0], ref.forward([30, 31])[0]).item()
    point = rt.savepoint()
    branch = rt.fork()
    rt.forward([40])
    with pytest.raises(BranchError):
        rt.undo(point)
    branch.rollback()
    rt.undo(point)
    assert rt.tokens == ref.tokens


def test_undo_returns_from_a_restore(tmp_path):
    """A prefill's restore undone (what a group does when another rank could not restore):
    the runtime holds what it held, and goes on as a runtime that never restored."""
    model = models.build("qwen3_5")
    store = open_store(tmp_path / "s", page_tokens=8)
    Runtime(model, store=store).prefill(PROMPT * 2)
    rt, fresh = Runtime(model, store=store), Runtime(model)
    rt.forward(PROMPT[:3])
    fresh.forward(PROMPT[:3])
    ids = PROMPT * 2 + [3]
    resume = rt.prefix_cache().resume(rt, ids, 3)
    assert resume.tokens > 3 and resume.states is not None
    point = rt.savepoint()
    rt.restore(ids[: resume.tokens], list(resume.states))
    assert rt.offset == resume.tokens
    rt.undo(point)
    rt.check()
    assert rt.tokens == PROMPT[:3]
    assert mx.array_equal(rt.forward(PROMPT[3:9])[0], fresh.forward(PROMPT[3:9])[0]).item()
    store.close()


# -- stores per rank -----------------------------------------------------------------------


def test_identity_names_the_shard(monkeypatch):
    """The shard is part of the identity; an unsharded model's identity is what it was."""
    from segcache.store import identity

    model = models.build("llama")
    assert shard_of(model) is None
    plain = identity.model_identity(model)
    ids = {}
    for shard in (Shard("tensor", 0, 2, (0, 2, 2)), Shard("tensor", 1, 2, (0, 2, 2)),
                  Shard("tensor", 0, 4, (0, 2, 2)), Shard("pipeline", 0, 2, (1, 2, 2))):
        monkeypatch.setattr(identity, "shard_of", lambda m, s=shard: s)
        ids[shard] = identity.model_identity(model)
    assert len(set(ids.values())) == 4 and plain not in ids.values()
    monkeypatch.setattr(identity, "shard_of", lambda m: None)
    assert identity.model_identity(model) == plain
    with pytest.raises(ValueError):
        Shard("tensor", 2, 2, (0, 2, 2))
    with pytest.raises(ValueError):
        Shard("data", 0, 2, (0, 2, 2))
    assert Shard("pipeline", 1, 2, (0, 2, 4)).directory == "rank-1-of-2"
    assert rank_path("/s", Shard("pipeline", 1, 2, (0, 2, 4))) == os.path.join("/s", "rank-1-of-2")
    assert rank_path("/s", None) == "/s"


def test_shard_of_a_pipelined_model():
    """shard_of reads mlx-lm's pipeline split off the model (a stand-in group: no collective runs)."""

    class Group:
        def rank(self):
            return 1

        def size(self):
            return 2

    model = models.build("qwen3_next")
    model.model.pipeline(Group())
    assert shard_of(model) == Shard("pipeline", 1, 2, (0, 2, 4))


@pytest.fixture(scope="module")
def written(model_dir, tmp_path_factory):
    """(store folder, ranks) of a launch that published into empty stores per rank: the first
    launch of the three tests below, run once; each works on a copy of its stores (`copied`)."""
    store = tmp_path_factory.mktemp("written") / "store"
    return store, ok(launch("store", model_dir, store, "write"))


def copied(written, store: Path) -> list[ranks.Rank]:
    """The written stores copied to `store` (no rank has them open); returns that launch's ranks."""
    shutil.copytree(written[0], store)
    return written[1]


def test_store_per_rank_resumes_after_a_restart(model_dir, written, tmp_path):
    """Both ranks publish into their own stores and stop; started again, they resume the prompt."""
    store = tmp_path / "store"
    first = copied(written, store)
    again = ok(launch("store", model_dir, store, "read"))
    for r in (0, 1):
        for w, rd in zip(first[r].json(), again[r].json()):
            assert w["stats"]["hit_tokens"] == 0 and w["stats"]["prefills"] == 1
            assert rd["stats"]["hit_tokens"] > 0, rd  # resumed from this rank's own records
            assert rd["close"] and w["close"] and rd["ranks_equal"]
            assert rd["logits"] == w["logits"]  # bit for bit what the first launch computed
            assert rd["dirs"] == ["rank-0-of-2", "rank-1-of-2"]


def test_a_prefix_is_a_hit_only_if_every_rank_holds_it(model_dir, written, tmp_path):
    """Rank 1's store is lost between two launches: rank 0 still holds the prompt, but every
    rank computes it (the ranks agree before resuming), with the same logits, and both
    stores hold it again afterwards."""
    store = tmp_path / "store"
    first = copied(written, store)
    for family_mode in ("qwen3_5-tensor", "qwen3_next-pipeline"):
        shutil.rmtree(store / family_mode / "rank-1-of-2")
    again = ok(launch("store", model_dir, store, "read"))
    healed = ok(launch("store", model_dir, store, "read"))
    for r in (0, 1):
        for w, rd, h in zip(first[r].json(), again[r].json(), healed[r].json()):
            assert rd["stats"]["hit_tokens"] == 0, rd  # rank 0 could have, but rank 1 could not
            assert rd["close"] and rd["ranks_equal"] and rd["logits"] == w["logits"]
            assert h["stats"]["hit_tokens"] > 0 and h["logits"] == w["logits"]


def test_stores_of_one_process_and_of_the_ranks_are_refused_both_ways(model_dir, written, tmp_path):
    """A deployment refuses a one-process store and a process the deployment's; a rank's own
    store, opened directly by one process, serves it no record (the identities differ)."""
    single = tmp_path / "single"
    for family in ("qwen3_5", "qwen3_next"):
        whole, _, _ = load(model_dir / family)  # a group of one: the whole model
        s = open_store(single / f"{family}-{'tensor' if family == 'qwen3_5' else 'pipeline'}", page_tokens=8)
        Runtime(whole, store=s).prefill(PROMPT * 2)
        s.close()
    for r in ok(launch("store", model_dir, single, "single-dir")):
        for res in r.json():
            assert res["refused"] and "single-process prefix store" in res["refused"], res

    ranked = tmp_path / "ranked"
    copied(written, ranked)
    with pytest.raises(StoreError, match="not empty"):
        open_store(ranked / "qwen3_5-tensor")
    whole, _, _ = load(model_dir / "qwen3_5")
    for r in (0, 1):
        s = open_store(ranked / "qwen3_5-tensor" / f"rank-{r}-of-2", ram_bytes=0, page_tokens=8)
        assert s.stats()["disk_bytes"] > 0  # the rank's records are there
        Runtime(whole, store=s).prefill(PROMPT * 2)
        assert s.stats()["hit_tokens"] == 0
        s.close()


PROMPT = [5, 9, 12, 7, 30, 31, 5, 9, 12, 7, 30, 31, 5, 9, 12, 40, 41, 42, 5, 9, 12]  # as dist_rank.py
