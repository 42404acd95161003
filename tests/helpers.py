"""Comparisons of runtime states for the tests."""

import mlx.core as mx


def layer_state(layer):
    """The arrays that determine a layer's future outputs, cut to what is live."""
    kind = type(layer).__name__
    if kind == "KVLayer":
        if layer.keys is None:
            return []
        return [layer.keys[..., : layer.offset, :], layer.values[..., : layer.offset, :]]
    if kind == "WindowLayer":
        if layer.keys is None:
            return []
        return [layer.keys, layer.values, mx.array([layer.offset, layer._idx])]
    return [a for a in layer.cache if a is not None] + [mx.array([layer.offset])]


def runtime_state(rt):
    return [layer_state(layer) for layer in rt.cache]


def assert_states_equal(a, b):
    """Bit-identical states (same shapes, same bits)."""
    sa, sb = runtime_state(a), runtime_state(b)
    assert len(sa) == len(sb)
    for i, (la, lb) in enumerate(zip(sa, sb)):
        assert len(la) == len(lb), f"layer {i}: {len(la)} vs {len(lb)} arrays"
        for x, y in zip(la, lb):
            assert x.shape == y.shape, f"layer {i}: shape {x.shape} vs {y.shape}"
            assert mx.array_equal(x, y).item(), f"layer {i}: arrays differ"


def snapshot(rt):
    """Evaluated copies of a runtime's state, immune to later writes."""
    state = runtime_state(rt)
    copies = [[mx.array(x) + 0 for x in layer] for layer in state]
    mx.eval(copies)
    return copies


def assert_snapshot_equal(snap, rt):
    now = runtime_state(rt)
    assert len(snap) == len(now)
    for i, (la, lb) in enumerate(zip(snap, now)):
        assert len(la) == len(lb), f"layer {i}"
        for x, y in zip(la, lb):
            assert x.shape == y.shape and mx.array_equal(x, y).item(), f"layer {i} changed"
