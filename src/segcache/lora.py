"""LoRA / DoRA adapters in a model, as the prefix store's identity sees them.

`mlx_lm.load(path, adapter_path=...)` (and `--adapter-path`) wraps layers of
the base model in mlx-lm's LoRA / DoRA modules (`mlx_lm.tuner`), whose
adapter parameters are the leaves mlx-lm's `load_adapters` loads: `lora_a`,
`lora_b` and DoRA's `m`; each module also scales its update by `scale`, a
plain attribute. An adapter changes every cached state, so the store identity
hashes all of it: where each adapted module sits, its class and scale, and
every byte of its adapter leaves (small next to the model: rank x width per
module). The sampled weights fingerprint (store/identity.py) would already
tell most adapters apart; this makes it exact, and covers the scale, which is
not a parameter.

A "full" fine-tune adapter replaces the base weights themselves; the weights
fingerprint covers those as it covers any other checkpoint. The draft model
and an MTP head are other model objects with identities of their own.
"""

from __future__ import annotations

import hashlib

import mlx.core as mx

ADAPTER_LEAVES = ("lora_a", "lora_b", "m")  # mlx_lm.tuner.utils.load_adapters' adapter_leaves
_PERSON = b"segcache.lora.1"


def adapted_modules(model) -> list[tuple[str, object]]:
    """(path, module) of every module carrying LoRA / DoRA leaves, in path order."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module.get("lora_a"), mx.array) and isinstance(module.get("lora_b"), mx.array):
            found.append((name, module))
    return sorted(found, key=lambda nm: nm[0])


def fingerprint(model) -> bytes | None:
    """32 bytes hashing every adapter module of `model` whole, or None if it has none."""
    modules = adapted_modules(model)
    if not modules:
        return None
    h = hashlib.blake2b(digest_size=32, person=_PERSON)
    leaves = []
    for name, module in modules:
        scale = getattr(module, "scale", None)
        scale = scale.tolist() if isinstance(scale, mx.array) else scale
        h.update(f"{name}|{type(module).__module__}.{type(module).__qualname__}|{scale!r};".encode())
        for leaf in ADAPTER_LEAVES:
            a = module.get(leaf)  # an mlx Module is the dict of its members
            if isinstance(a, mx.array):
                h.update(f"{leaf}|{tuple(a.shape)}|{a.dtype};".encode())
                leaves.append(a.reshape(-1).view(mx.uint8) if a.dtype != mx.bool_ else a.reshape(-1).astype(mx.uint8))
    data = mx.concatenate(leaves)
    mx.eval(data)
    h.update(memoryview(data))
    return h.digest()
