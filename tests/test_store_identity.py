import segcache  # noqa: F401  (binds OpenBLAS before mlx)

import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn

from segcache.store import chain_key, model_identity, prefix_keys, root_key, weights_fingerprint

MAKE = """
import mlx.core as mx
from mlx_lm.models import llama, qwen3_next
def tiny(seed, dtype=mx.float32, window=None):
    args = llama.ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                           num_attention_heads=4, rms_norm_eps=1e-5, vocab_size=64, num_key_value_heads=2)
    mx.random.seed(seed)
    m = llama.Model(args)
    m.set_dtype(dtype)
    mx.eval(m.parameters())
    return m
"""
exec(MAKE)


def test_same_config_other_weights_other_identity():
    assert model_identity(tiny(0)) != model_identity(tiny(1))
    assert weights_fingerprint(tiny(0)) != weights_fingerprint(tiny(1))


def test_dtype_salt_and_page_size_change_identity():
    base = model_identity(tiny(0))
    assert model_identity(tiny(0)) == base
    assert model_identity(tiny(0, mx.bfloat16)) != base
    assert model_identity(tiny(0), salt="tenant-a") != base
    assert model_identity(tiny(0), salt="tenant-a") != model_identity(tiny(0), salt="tenant-b")
    assert model_identity(tiny(0), page_tokens=128) != base


def test_one_changed_sampled_weight_changes_identity():
    m = tiny(0)
    before = weights_fingerprint(m)
    w = m.layers[0].mlp.up_proj.weight
    m.layers[0].mlp.up_proj.weight = mx.concatenate([w[:-1], w[-1:] + 1])  # the last element is always sampled
    assert weights_fingerprint(m) != before


def test_identity_is_stable_in_a_fresh_process():
    code = MAKE + "from segcache.store import model_identity\nprint(model_identity(tiny(0)).hex())"
    out = subprocess.run([sys.executable, "-c", "import segcache\n" + code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == model_identity(tiny(0)).hex()


def test_fingerprint_of_a_gigabyte_model_returns():
    class Big(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = [nn.Linear(4096, 4096, bias=False) for _ in range(16)]  # 1.07 GB fp32
            for layer in self.layers:  # a gigabyte held, not drawn: the sampled read is what is timed
                layer.weight = mx.zeros((4096, 4096))

    big = Big()
    mx.eval(big.parameters())
    assert len(weights_fingerprint(big)) == 32  # timing: bench/store_codec.py


def test_keys_chain_and_separate_identities():
    a, b = model_identity(tiny(0)), model_identity(tiny(1))
    toks = list(range(10))
    assert root_key(a) != root_key(b)
    k1 = chain_key(root_key(a), toks[:5], a)
    assert chain_key(k1, toks[5:], a) == chain_key(chain_key(root_key(a), toks[:5], a), toks[5:], a)
    assert chain_key(k1, toks[5:], a) != chain_key(root_key(a), toks, a)  # paging is part of the key
    assert chain_key(root_key(a), toks, a) != chain_key(root_key(b), toks, b)
    assert len(prefix_keys(list(range(600)), a, 256)) == 2
    assert prefix_keys(list(range(600)), a, 256)[0] == chain_key(root_key(a), list(range(256)), a)
