"""Chat training data and training on a fixed system turn (the chat stages share these).

The chat stages teach the shipped target the Qwen3.5 chat format with tool calls
(issue 20 item 6): the tokenizer gains the format's markup tokens, the target's
embedding gains their rows, and the target is trained further on a mix of the
stdlib code stream and synthetic tool-calling dialogs (tools/demo_dialogs.py).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

import demo_dialogs
from segcache.mtp.module import _text_parts
from training.common import SEED
from training.corpus import stdlib_root, stdlib_split, training_token_stream
from training.loop import LoopResult, Schedule, train_loop

HELDOUT_DIALOGS_FILE = "heldout_dialogs.json"
HELDOUT_DIALOGS = 40
CHAT_CODE_TOKENS = "chat_code_tokens.npy"

# Settings of the chat fine-tune of the target (``chat-train``). Each step takes
# ``dialog_rows`` dialog-body windows (on their system turn, see ChatBatches) and
# ``code_rows`` windows of the code stream, ``seq_len`` tokens each; the loss is
# ``dialog_weight`` x the mean cross-entropy over the dialogs' assistant tokens +
# the rest x the code windows'. ``chat-prepare`` and ``chat-drills`` read their
# seeds and sizes from here too.
CHAT_DEFAULTS = {"steps": 4000, "dialog_rows": 3, "code_rows": 1, "seq_len": 512,
                 "lr": 1e-3, "warmup": 20, "max_minutes": 60.0, "seed": SEED + 4,
                 "dialogs": 1500, "dialog_weight": 0.5, "drill_rows": 0, "drills": 3000,
                 "cooldown_start": None, "cooldown_steps": None}


def chat_workspaces():
    """The training and held-out stdlib files as two dialog workspaces (paths stdlib-relative)."""
    root = stdlib_root()
    train, heldout = stdlib_split()
    return tuple(demo_dialogs.Workspace.from_sources(
        [(path.relative_to(root).as_posix(), text) for path, text in sources])
        for sources in (train, heldout))


def split_prefix(tokenizer, dialog: dict, tokens: list[int]) -> int:
    """Length of a rendered dialog's system turn (tool schemas and/or system message), 0 if none."""
    if dialog["tools"] is None and dialog["messages"][0]["role"] != "system":
        return 0
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    return tokens.index(start, 1)  # where the next turn starts


def chat_code(work: Path) -> np.ndarray:
    """The code stream in the chat tokenizer's ids (``chat-prepare`` caches it)."""
    return training_token_stream(work, work / "chat_tokenizer", cache_name=CHAT_CODE_TOKENS)


class ChatBatches:
    """Batches of dialog-body windows on one system turn plus code windows, seeded.

    Each step draws a variant (in proportion to its dialogs), ``dialog_rows`` body
    windows of it that start at a dialog, and ``code_rows`` windows of the code
    stream, ``seq_len`` tokens each. Yields ``(prefix, x, y, mask, xc, yc)``: the
    variant's system-turn tokens ``[1, P]`` (``None`` when it has none), the body
    inputs, next-token targets and loss mask (assistant tokens) ``[dialog_rows,
    seq_len]``, and the code inputs and targets ``[code_rows, seq_len]``; with
    ``drill_rows``, also ``(xd, yd, md)``: windows of the copy drills
    (``chat-drills``) that start at a conversation, with their loss mask.
    """

    def __init__(self, work: Path, *, dialog_rows: int, code_rows: int, seq_len: int,
                 seed: int, code: np.ndarray, drill_rows: int = 0):
        data = np.load(work / "chat_dialogs.npz")
        self.drill_rows = drill_rows
        if drill_rows:
            drills = np.load(work / "chat_drills.npz")
            pad = np.zeros(seq_len + 1, drills["ids"].dtype)
            self.drills = (np.concatenate([drills["ids"], pad]),
                           np.concatenate([drills["mask"], pad.astype(np.uint8)]), drills["starts"])
        self.variants = []
        n = seq_len + 1
        for i in range(len([k for k in data.files if k.startswith("prefix_")])):
            ids, mask = data[f"ids_{i}"], data[f"mask_{i}"]
            # pad the stream so that a window may start at its last dialog
            ids = np.concatenate([ids, np.zeros(n, ids.dtype)])
            mask = np.concatenate([mask, np.zeros(n, mask.dtype)])
            self.variants.append((data[f"prefix_{i}"], ids, mask, data[f"starts_{i}"]))
        dialogs = np.array([len(v[3]) for v in self.variants], dtype=np.float64)
        self.weights = dialogs / dialogs.sum()
        self.code, self.seq_len = code, seq_len
        self.dialog_rows, self.code_rows = dialog_rows, code_rows
        self.rng = np.random.default_rng(seed)

    def __iter__(self):
        return self

    def __next__(self):
        n = self.seq_len + 1
        prefix, ids, mask, starts = self.variants[
            self.rng.choice(len(self.variants), p=self.weights)]
        picks = self.rng.choice(starts, size=self.dialog_rows)
        windows = np.stack([ids[s:s + n] for s in picks]).astype(np.int32)
        masks = np.stack([mask[s:s + n] for s in picks])[:, 1:].astype(np.float32)
        code_starts = self.rng.integers(0, len(self.code) - n, size=self.code_rows)
        code = np.stack([self.code[s:s + n] for s in code_starts]).astype(np.int32)
        prefix = mx.array(prefix.astype(np.int32))[None] if len(prefix) else None
        batch = (prefix, mx.array(windows[:, :-1]), mx.array(windows[:, 1:]), mx.array(masks),
                 mx.array(code[:, :-1]), mx.array(code[:, 1:]))
        if not self.drill_rows:
            return batch
        ids, mask, starts = self.drills
        picks = self.rng.choice(starts, size=self.drill_rows)
        drills = np.stack([ids[s:s + n] for s in picks]).astype(np.int32)
        drill_mask = np.stack([mask[s:s + n] for s in picks])[:, 1:].astype(np.float32)
        return batch + (mx.array(drills[:, :-1]), mx.array(drills[:, 1:]), mx.array(drill_mask))


def train_on_chat(step_fn, optimizer, batches: ChatBatches, settings: dict, *, checkpoint,
                  checkpoint_every: int, log_every: int, loss_names: tuple[str, ...]) -> LoopResult:
    """:func:`training.loop.train_loop` over chat batches with the schedule ``settings`` give."""
    return train_loop(step_fn, optimizer, batches, schedule=Schedule.of(settings),
                      batch=settings["dialog_rows"] + settings["code_rows"],
                      seq_len=settings["seq_len"], checkpoint=checkpoint,
                      checkpoint_every=checkpoint_every, log_every=log_every,
                      loss_names=loss_names)


def chat_batches(work: Path, settings: dict, drill_rows: int = 0) -> ChatBatches:
    """The chat batches a training stage's ``settings`` ask for, on the work dir's data."""
    return ChatBatches(work, dialog_rows=settings["dialog_rows"],
                       code_rows=settings["code_rows"], seq_len=settings["seq_len"],
                       seed=settings["seed"], code=chat_code(work), drill_rows=drill_rows)


class FixedKV:
    """An attention layer's cache holding a fixed prefix, for training on top of it.

    ``update_and_fetch`` returns the prefix joined with the new keys/values and
    stores nothing, so the loss function stays pure (no in-place writes).
    """

    def __init__(self, keys: mx.array, values: mx.array):
        self.keys, self.values = keys, values
        self.offset = keys.shape[2]

    def update_and_fetch(self, keys, values):
        return (mx.concatenate([self.keys, keys], axis=2),
                mx.concatenate([self.values, values], axis=2))

    def make_mask(self, N, return_array=False, window_size=None):
        return create_causal_mask(N, offset=self.offset, window_size=window_size)


def cache_state(caches: list) -> list[tuple[mx.array, mx.array]]:
    """Per layer, what a filled prompt cache holds: (keys, values) or (conv, ssm) state."""
    return [(c.keys[..., :c.offset, :], c.values[..., :c.offset, :])
            if isinstance(c, KVCache) else (c[0], c[1]) for c in caches]


def prefix_state(model: nn.Module, prefix: mx.array) -> list[tuple[mx.array, mx.array]]:
    """Per layer, the state after ``prefix`` ``[1, P]``: (keys, values) or (conv, ssm)."""
    caches = make_prompt_cache(model)
    model(prefix, cache=caches)
    return [tuple(mx.stop_gradient(a) for a in pair) for pair in cache_state(caches)]


def caches_from_state(model: nn.Module, state, rows: int) -> list:
    """Fresh training caches for ``rows`` rows from :func:`prefix_state`'s arrays."""
    caches = []
    for c, (a, b) in zip(model.make_cache(), state):
        a = mx.broadcast_to(a, (rows, *a.shape[1:]))
        b = mx.broadcast_to(b, (rows, *b.shape[1:]))
        if isinstance(c, KVCache):
            caches.append(FixedKV(a, b))
        else:
            arrays = ArraysCache(size=2)
            arrays[0], arrays[1] = a, b
            caches.append(arrays)
    return caches


class FrozenForward:
    """A frozen model's forward over chat batches, its system turns' state computed once.

    ``hidden_and_logprobs(prefix, x)`` returns the final hidden states (after the
    final norm, as :func:`segcache.mtp.forward_with_hidden` gives them) and the
    next-token log-probabilities of the rows ``x`` run on the variant's system turn.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.model.eval()
        self.model.freeze()
        _, self.text_model, self.projection, _ = _text_parts(model)
        self.prefixes: dict[tuple, tuple] = {}

    def prefix(self, prefix: mx.array):
        """(per-layer state, hidden [1, P, H]) after the system turn ``prefix``."""
        key = tuple(prefix[0].tolist())
        if key not in self.prefixes:
            caches = make_prompt_cache(self.model)
            hidden = self.text_model(prefix, caches)
            state = cache_state(caches)
            mx.eval(state, hidden)
            self.prefixes[key] = (state, hidden)
        return self.prefixes[key]

    def hidden_and_logprobs(self, prefix, x):
        caches = None
        if prefix is not None:
            state, _ = self.prefix(prefix)
            caches = caches_from_state(self.model, state, x.shape[0])
        hidden = self.text_model(x, caches)
        logits = self.projection(hidden).astype(mx.float32)
        return hidden, logits - mx.logsumexp(logits, axis=-1, keepdims=True)
