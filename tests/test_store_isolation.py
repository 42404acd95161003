"""Isolation domains of the prefix cache (issue 24, item 4): a runtime's `cache_salt`.

Two salts never share a prefix (pages, checkpoints, the index nodes that would tell
where prompts part), the same salt does, and no salt is a domain of its own. The
resumed state under a salt is the state computed cold.
"""

import segcache  # noqa: F401, I001  (binds the system BLAS before mlx loads)

import random

import mlx.core as mx
import pytest

from conftest import tiny
from segcache import Runtime, open_store
from segcache.testing import models

P = 16


def ids(n, seed=0):
    rnd = random.Random(seed)
    return [rnd.randrange(models.VOCAB) for _ in range(n)]


def resumed(store, model, prompt, salt):
    """Tokens a prefill of `prompt` in domain `salt` restores from the store (and its logits)."""
    steps = Runtime(model, store=store, cache_salt=salt).prefill_steps(prompt)
    first = next(steps)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return first.restored, done.value


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "gemma3_text"])
def test_two_salts_never_share_a_prefix_and_the_same_salt_does(tmp_path, family):
    model, secret = tiny(family), ids(40, seed=1)
    guess = secret[:30] + ids(6, seed=2)  # shares 30 tokens (more than a page) with the secret
    with open_store(tmp_path, ram_bytes=1 << 26, disk_bytes=1 << 28, page_tokens=P) as store:
        assert resumed(store, model, secret, "alice")[0] == 0
        before = {e.key: e.nbytes for e in store.entries()}
        for other in ("bob", None, "Alice", b"alice!"):  # another domain: nothing to resume, whole or part
            assert resumed(store, model, secret + [5], other)[0] == 0, other
        for other in ("carol", b"alice?"):
            assert resumed(store, model, guess, other)[0] == 0, other
        # the other domains wrote records of their own and left alice's as they were (her index
        # nodes, which tell where prompts part, gained nothing from their prompts)
        after = {e.key: e.nbytes for e in store.entries()}
        assert len(after) > len(before) and all(after[k] == n for k, n in before.items())
        got, logits = resumed(store, model, secret + [5], "alice")
        assert got == 40  # the same salt resumes the whole prompt
        want = Runtime(model).prefill(secret + [5])
        assert mx.allclose(logits, want, atol=1e-4, rtol=1e-4).item()
        # the same salt shares what it shares: a stateful model checkpoints where the prompts part
        # on the first guess, and resumes there on the next
        resumed(store, model, guess, "alice")
        assert resumed(store, model, guess + [9], "alice")[0] >= 30
        store.evict_ram(0)
        assert resumed(store, model, secret + [6], "alice")[0] == 40  # from disk, same domain
        assert resumed(store, model, secret + [6], "mallory")[0] == 0


def test_a_clone_and_a_publish_stay_in_their_domain(tmp_path):
    model, prompt = tiny("qwen3_5"), ids(40, seed=3)
    with open_store(tmp_path, ram_bytes=1 << 26, disk_bytes=1 << 28, page_tokens=P) as store:
        rt = Runtime(model, store=store, cache_salt="tenant-a")
        rt.forward(prompt)
        twin = rt.clone()
        assert twin.cache_salt == "tenant-a"
        twin.forward([7, 8])
        twin.publish()  # prompt + 2 tokens, under tenant-a
        assert resumed(store, model, prompt + [7, 8, 9], "tenant-b")[0] == 0
        assert resumed(store, model, prompt + [7, 8, 9], None)[0] == 0
        assert resumed(store, model, prompt + [7, 8, 9], "tenant-a")[0] == 42


@pytest.mark.parametrize("bad", ["", b"", 3, ["a"]])
def test_a_salt_is_a_non_empty_str_or_bytes(bad):
    with pytest.raises(ValueError, match="cache_salt"):
        Runtime(tiny("llama"), cache_salt=bad)
