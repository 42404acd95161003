"""A conversation's next turn, resumed from RAM: time to first token and bytes held, against `mlx_lm.server`.

    python bench/warm.py [--model DIR] [--contexts 1000,2000,3200] [--turns 5] [--rounds 3] [--tokens 16]
                         [--no-servers] [--no-inproc] [--mlx-blas same|wheel] [--api chat|completions]

`--api completions` sends the servers' turns to /v1/completions as completion-style agents and
editors do: each prompt is the previous prompt, its answer and the next question, as text.

TTFT: three servers on the same model, started side by side on 127.0.0.1 and
driven by the official `openai` client (streamed greedy chat completions):
segcache serve (its defaults: the hot conversation runtimes on),
segcache serve --hot-conversations 0 (every turn resumed from the store's RAM
pages, as before them) and mlx_lm.server. For each context size, --rounds
conversations: a system prompt of about that many tokens and a question
(turn 1, cold, not counted), then --turns - 1 warm turns (the answer + a new
question of ~60 tokens each), every turn sent to the three servers one after
another in a rotating order. The TTFT of a turn is request sent -> first
chunk with text; the report gives medians per context and the ratios to
mlx_lm.server's median, and the cached tokens each server reported.
A model without a chat template gets the Qwen3-style one of bench/agent.py.

In process (the same model, the same token sequences, so mlx-lm's path finds
its whole conversation every turn, as the servers' templates may not let it):
segcache's engine as `segcache serve --decode-concurrency 1` runs it (a RAM
store, hot runtimes; and again with every turn resumed from the store) against mlx-lm's
`LRUPromptCache` fed as mlx_lm.server's one-request path feeds it (nearest
cache fetched as a deep copy, `stream_generate` on it, prompt + answer
inserted back), interleaved turn by turn: the warm turns' TTFT (submit ->
first token). Then each alone: the bytes MLX holds for the conversation once
its turns ended (`mx.get_active_memory()` after minus before, caches cleared;
segcache: its store's RAM tier, not flushed meanwhile, and its hot runtime;
mlx-lm: its LRU, and the last cache alone).
"""

from __future__ import annotations

import argparse
import gc
import glob
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import segcache  # noqa: F401, I001  (binds OpenBLAS before mlx loads)

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import stream_generate
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache
from mlx_lm.tokenizer_utils import load as load_tokenizer

from segcache import open_store
from segcache.serve.engine import Chunk, Engine, GenRequest
from segcache.serve.hot import HotRuntimes
from segcache.serve.worker import Job, Scheduler

from agent import prepare_model  # bench/agent.py
from serve import MODELS, Proc, _port  # bench/serve.py

CORPUS = MODELS / "heldout_stdlib.txt"


def ttft_of(client, messages: list, tokens: int) -> tuple[float, str, int]:
    """(seconds to the first text chunk, the answer, cached tokens reported) of one chat turn."""
    tic = time.perf_counter()
    ttft, text, cached = None, [], -1
    for ev in client.chat.completions.create(model="default_model", messages=messages, max_tokens=tokens,
                                             temperature=0.0, stream=True, stream_options={"include_usage": True}):
        piece = ev.choices[0].delta.content if ev.choices else None
        if piece and ttft is None:
            ttft = time.perf_counter() - tic
        text.append(piece or "")
        if ev.usage is not None and ev.usage.prompt_tokens_details is not None:
            cached = ev.usage.prompt_tokens_details.cached_tokens or 0
    return (ttft if ttft is not None else time.perf_counter() - tic), "".join(text), cached


def completion_ttft_of(client, prompt: str, tokens: int) -> tuple[float, str, int]:
    """(seconds to the first text chunk, the answer, cached tokens reported) of one completion."""
    tic = time.perf_counter()
    ttft, text, cached = None, [], -1
    for ev in client.completions.create(model="default_model", prompt=prompt, max_tokens=tokens, temperature=0.0,
                                        stream=True, stream_options={"include_usage": True}):
        piece = ev.choices[0].text if ev.choices else None
        if piece and ttft is None:
            ttft = time.perf_counter() - tic
        text.append(piece or "")
        if ev.usage is not None and ev.usage.prompt_tokens_details is not None:
            cached = ev.usage.prompt_tokens_details.cached_tokens or 0
    return (ttft if ttft is not None else time.perf_counter() - tic), "".join(text), cached


def conversation_text(corpus: str, chars_per_token: float, context: int, r: int) -> tuple[str, list[str]]:
    """A system prompt of about `context` tokens (round r's own slice) and the questions of its turns."""
    n = int(context * chars_per_token)
    start = (r * 7919) % max(1, len(corpus) - n - 8000)
    system = corpus[start : start + n]
    questions = [corpus[start + n + 300 * k : start + n + 300 * k + 220] for k in range(16)]
    return system, questions


def run_ttft(args, model: Path, work: Path, cpt: float) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1] / "src"),
                                                                    os.environ.get("PYTHONPATH")])))
    mlx_env = dict(env)
    libs = glob.glob("/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0")
    if args.mlx_blas == "same" and libs and sys.platform.startswith("linux"):
        mlx_env.update(LD_PRELOAD=libs[0], OPENBLAS_THREAD_TIMEOUT="4")

    def seg(name: str, *extra: str) -> Proc:
        port = _port()
        return Proc(name, [sys.executable, "-m", "segcache.cli", "serve", "--model", str(model), "--port", str(port),
                           "--prompt-cache-dir", str(work / name), "--log-level", "WARNING", *extra], env, port,
                    work / f"{name}.log")

    port = _port()
    procs = [seg("segcache"), seg("segcache-nohot", "--hot-conversations", "0"),
             Proc("mlx_lm.server", [sys.executable, "-m", "mlx_lm.server", "--model", str(model), "--port", str(port),
                                    "--log-level", "WARNING"], mlx_env, port, work / "mlx_lm.log")]
    corpus = CORPUS.read_text()
    try:
        for p in procs:
            p.start()
        clients = [p.client() for p in procs]
        rows = []
        for context in args.contexts:
            ttfts = {p.name: [] for p in procs}
            cached = {p.name: [] for p in procs}
            for r in range(args.rounds):
                system, questions = conversation_text(corpus, cpt, context, r)
                if args.api == "chat":
                    histories = [[{"role": "system", "content": system}, {"role": "user", "content": questions[0]}]
                                 for _ in procs]
                else:
                    histories = [system + "\n" + questions[0] for _ in procs]
                for turn in range(args.turns):
                    order = [(turn + r + i) % len(procs) for i in range(len(procs))]  # rotate who goes first
                    for i in order:
                        if args.api == "chat":
                            t, text, c = ttft_of(clients[i], histories[i], args.tokens)
                            histories[i] += [{"role": "assistant", "content": text},
                                             {"role": "user", "content": questions[turn + 1]}]
                        else:
                            t, text, c = completion_ttft_of(clients[i], histories[i], args.tokens)
                            histories[i] += text + "\n" + questions[turn + 1]
                        if turn:  # turn 1 is cold
                            ttfts[procs[i].name].append(t)
                            cached[procs[i].name].append(c)
            med = {n: statistics.median(v) for n, v in ttfts.items()}
            rows.append((context, med, cached))
            print(f"context ~{context} tokens: " + ", ".join(f"{n} {m * 1000:.1f} ms" for n, m in med.items())
                  + f"; segcache / mlx_lm.server {med['segcache'] / med['mlx_lm.server']:.2f}x, without hot "
                  f"{med['segcache-nohot'] / med['mlx_lm.server']:.2f}x", flush=True)
            for n, v in cached.items():
                print(f"    {n:<15} cached tokens per warm turn: {v}")
        print(f"\nwarm-turn TTFT ({args.api}), medians (ms) and ratios to mlx_lm.server (same run, interleaved):")
        print(f"{'context':>8} {'segcache':>9} {'no hot':>9} {'mlx_lm':>9} {'ratio':>7} {'no hot':>7}")
        for context, med, _ in rows:
            m = med["mlx_lm.server"]
            print(f"{context:>8} {med['segcache'] * 1000:9.1f} {med['segcache-nohot'] * 1000:9.1f} {m * 1000:9.1f} "
                  f"{med['segcache'] / m:6.2f}x {med['segcache-nohot'] / m:6.2f}x")
    finally:
        for p in procs:
            p.stop()


def _settle() -> int:
    gc.collect()
    mx.clear_cache()
    return mx.get_active_memory()


class _Answers(HotRuntimes):
    """Hot runtimes that no turn continues from: a store-only engine, its answers' tokens kept."""

    def take(self, ids, domain):
        return None


class SegcacheConversation:
    """One conversation on segcache's engine as `segcache serve --decode-concurrency 1` runs it: a RAM
    store (not flushed meanwhile), hot runtimes (or, with `hot` False, every turn resumed from the store)."""

    def __init__(self, model, tok, path: str, hot: bool):
        self.store = open_store(path, ram_bytes=1 << 30)
        self.hot = HotRuntimes() if hot else _Answers(1, 1 << 30, share=False)
        # one request at a time, as mlx-lm's one-request path below (the servers above batch, both)
        self.engine = Engine(model, tok, store=self.store, decode_concurrency=1, hot=self.hot)
        self.sched = Scheduler(self.engine, max_queue=4, max_running=1, begin_step=self.engine.begin_step)
        self.held: list[int] = []

    def turn(self, ids: list[int], tokens: int) -> float:
        """TTFT of one turn (submit -> its first chunk); `held` becomes prompt + answer."""
        first, tic = [], time.perf_counter()

        def sink(e):
            if not first and isinstance(e, Chunk):
                first.append(time.perf_counter() - tic)

        self.sched.submit(Job(GenRequest(f"t{time.monotonic_ns()}", ids, tokens), sink))
        while self.sched.step():
            pass
        self.held = list(self.hot._entries.values())[-1].tokens
        return first[0]

    def close(self) -> None:
        self.store.close()


class MlxLmConversation:
    """One conversation on mlx_lm.server's one-request path: the nearest cache fetched (a deep
    copy), `stream_generate` on it, prompt + answer inserted back into its `LRUPromptCache`."""

    def __init__(self, model, tok):
        self.model, self.tok, self.lru = model, tok, LRUPromptCache()
        self.held: list[int] = []

    def turn(self, ids: list[int], tokens: int) -> float:
        tic = time.perf_counter()
        cache, rest = self.lru.fetch_nearest_cache("m", ids)
        if cache is None:
            cache = make_prompt_cache(self.model)
        out, ttft = [], None
        for r in stream_generate(self.model, self.tok, rest, max_tokens=tokens, prompt_cache=cache):
            ttft = ttft if ttft is not None else time.perf_counter() - tic
            out.append(r.token)
        self.lru.insert_cache("m", ids + out, cache)
        self.held = ids + out
        return ttft

    def close(self) -> None:
        pass


def _talk(conv, first: list[int], news: list[list[int]], turns: int, tokens: int) -> None:
    for k in range(turns):
        conv.turn(first if k == 0 else conv.held + news[k - 1], tokens)


def run_inproc(args, model_dir: Path, cpt: float) -> None:
    """The same token sequences on segcache's engine (hot and not) and on mlx-lm's cache path,
    interleaved turn by turn in this process: TTFT of the warm turns; then each alone, the bytes
    a conversation holds after its turns."""
    model, tok = mlx_lm.load(str(model_dir))
    corpus = CORPUS.read_text()
    Engine(model, tok).warm_up()
    print("\nin process, the same tokens (mlx-lm's path resumes its whole conversation every turn):")
    print(f"{'context':>8} {'hot':>7} {'no hot':>7} {'mlx-lm':>7} {'ratio':>6} {'no hot':>6}   (warm-turn TTFT, "
          "medians, ms)  |  bytes after the turns: tokens, segcache (store + hot runtime), mlx-lm's LRU, ratio, "
          "mlx-lm's last cache alone, ratio")
    for context in args.contexts:
        times: dict[str, list[float]] = {"hot": [], "nohot": [], "mlx": []}
        with tempfile.TemporaryDirectory() as d:
            for r in range(args.rounds):
                system, questions = conversation_text(corpus, cpt, context, r)
                first, news = tok.encode(system + questions[0]), [tok.encode(q) for q in questions[1:]]
                convs = {"hot": SegcacheConversation(model, tok, f"{d}/hot{r}", True),
                         "nohot": SegcacheConversation(model, tok, f"{d}/nohot{r}", False),
                         "mlx": MlxLmConversation(model, tok)}
                for k in range(args.turns):
                    names = list(convs)
                    for name in names[(k + r) % 3:] + names[: (k + r) % 3]:  # rotate who goes first
                        c = convs[name]
                        t = c.turn(first if k == 0 else c.held + news[k - 1], args.tokens)
                        if k:
                            times[name].append(t)
                for c in convs.values():
                    c.close()
                del convs, c
            system, questions = conversation_text(corpus, cpt, context, 0)
            first, news = tok.encode(system + questions[0]), [tok.encode(q) for q in questions[1:]]
            base = _settle()
            seg = SegcacheConversation(model, tok, f"{d}/mem", True)
            _talk(seg, first, news, args.turns, args.tokens)
            seg_bytes, n_tokens = _settle() - base, len(seg.held)
            seg.close()
            del seg
            base = _settle()
            mlx = MlxLmConversation(model, tok)
            _talk(mlx, first, news, args.turns, args.tokens)
            mlx_bytes = _settle() - base
            mlx_last = sum(c.nbytes for c in mlx.lru._trie.get("m", mlx.held).prompt_cache)
            del mlx
        m = {n: statistics.median(v) * 1000 for n, v in times.items()}
        print(f"{context:>8} {m['hot']:7.1f} {m['nohot']:7.1f} {m['mlx']:7.1f} {m['hot'] / m['mlx']:5.2f}x "
              f"{m['nohot'] / m['mlx']:5.2f}x   |  {n_tokens} tokens: {seg_bytes / 2**20:.2f}M, {mlx_bytes / 2**20:.2f}M, "
              f"{seg_bytes / mlx_bytes:.2f}x; {mlx_last / 2**20:.2f}M, {seg_bytes / mlx_last:.2f}x", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(MODELS / "target"))
    ap.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[1000, 2000, 3200],
                    help="context sizes in tokens (default 1000,2000,3200: the shipped target's context is 4,096)")
    ap.add_argument("--turns", type=int, default=5, help="turns per conversation; the first is cold (default 5)")
    ap.add_argument("--rounds", type=int, default=3, help="conversations per context size (default 3)")
    ap.add_argument("--tokens", type=int, default=16, help="tokens per answer at most (default 16)")
    ap.add_argument("--mlx-blas", choices=["same", "wheel"], default="same")
    ap.add_argument("--api", choices=["chat", "completions"], default="chat",
                    help="the servers' route: chat turns, or completion prompts that extend the last prompt and answer")
    ap.add_argument("--no-servers", action="store_true", help="skip the three servers' pass")
    ap.add_argument("--no-inproc", action="store_true", help="skip the in-process pass (same tokens; bytes held)")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="segcache-warm-"))
    model, how = prepare_model(args.model, work, False)
    sample = CORPUS.read_text()[:20000]
    cpt = len(sample) / len(load_tokenizer(model).encode(sample))
    print(f"model {args.model} with {how}; {args.rounds} conversations x {args.turns} turns per context; "
          f"{args.tokens} tokens per answer; ~{cpt:.2f} characters per token; logs in {work}")
    print(f"segcache.BLAS {segcache.BLAS}; the machine may be shared: ratios are from the same interleaved run")
    if not args.no_servers:
        run_ttft(args, model, work, cpt)
    if not args.no_inproc:
        run_inproc(args, model, cpt)
    return 0


if __name__ == "__main__":
    sys.exit(main())
