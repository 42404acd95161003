"""Sampling controls and structured output: what they cost per token and per round.

1. Structured output on a ~150k-token byte-level BPE vocabulary: grammar
   compile time, and per token the mask (llguidance's bitmask alone, then
   segcache's [1, V] bool mask on the device) plus the advance; per verify
   round of K=4 drafts, the K+1 masks. outlines-core (an up-front index per
   schema) runs beside it when installed, for the choice of engine.
2. Processors per round: `Processors.process` on a verify's logits [K+1, V]
   (V = 151936, K = 0, 4, 8) for each control, and the sampler's distribution.
3. `--decode`: the serving engine's tokens per second on the shipped target
   with each control off and on, one row and 8 rows, plain and speculative
   (prompt lookup, the shipped draft model), and the share of speculation's
   speed-up a control keeps; then n = 1, 4, 8 choices of one request against
   n separate requests (time, and the peak memory of the prompts' state).

The vocabulary: `--tokenizer PATH` (a tokenizer.json), else a byte-level BPE
of 150k tokens trained once on the Python sources installed here (~3 min on
2 cores), cached under ~/.cache/segcache/bench/.

    python bench/sampling.py [--quick] [--tokenizer PATH] [--skip-outlines]
    python bench/sampling.py --decode [--quick]      # 3. only
"""

from __future__ import annotations

import _common as C  # noqa: I001  (first: binds OpenBLAS before mlx loads)

import argparse
import glob
import json
import os
import statistics
import sys
import sysconfig
import time

import mlx.core as mx
import mlx_lm
import numpy as np

from segcache.grammar import Grammars
from segcache.processors import make_processors
from segcache.sampling import Keys, Sampler

VOCAB = 151936  # a Qwen-sized logits width for the processor figures
CACHE = os.path.expanduser("~/.cache/segcache/bench")

OBJ = {"type": "object", "additionalProperties": False}
CASES = {
    "person": ({**OBJ, "properties": {"name": {"type": "string", "maxLength": 40},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                      "email": {"type": "string"}},
                "required": ["name", "age", "email"]},
               {"name": "Ada Lovelace", "age": 36, "email": "ada@analytical.engine"}),
    "nested": ({**OBJ, "properties": {
        "order": {**OBJ, "properties": {"id": {"type": "integer"}, "status": {"enum": ["open", "shipped", "closed"]}},
                  "required": ["id", "status"]},
        "lines": {"type": "array", "items": {**OBJ, "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "qty": {"type": "integer", "minimum": 1},
            "note": {"type": "string"}}, "required": ["sku", "qty"]}}},
        "required": ["order", "lines"]},
        {"order": {"id": 90210, "status": "shipped"},
         "lines": [{"sku": "ABC-1234", "qty": 2, "note": "gift wrap, please"}, {"sku": "XYZ-0001", "qty": 11}]}),
    "code": ({**OBJ, "properties": {"language": {"enum": ["python", "rust", "go"]},
                                    "source": {"type": "string"}, "tests": {"type": "array", "items": {"type": "string"}}},
              "required": ["language", "source", "tests"]},
             {"language": "python", "source": "def add(a, b):\n    return a + b\n",
              "tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]}),
}


def layout(value) -> str:
    """The text segcache's grammars produce for `value` (", " and ": ", no newlines)."""
    return json.dumps(value, separators=(", ", ": "))


def bpe_tokenizer(path: str | None, size: int = 150_000):
    """A fast HF tokenizer of ~`size` tokens (trained once and cached when no path is given)."""
    from transformers import PreTrainedTokenizerFast

    if path is None:
        path = os.path.join(CACHE, f"bpe-{size // 1000}k.json")
        if not os.path.exists(path):
            from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

            roots = {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]}
            files = sorted(f for r in roots for f in glob.glob(os.path.join(r, "**", "*.py"), recursive=True))
            print(f"training a {size}-token byte-level BPE on {len(files)} Python files (once) ...", flush=True)
            tok = Tokenizer(models.BPE())
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
            tok.decoder = decoders.ByteLevel()
            tok.train(files, trainers.BpeTrainer(vocab_size=size, min_frequency=2, show_progress=False,
                                                 special_tokens=["<|endoftext|>"],
                                                 initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
            os.makedirs(CACHE, exist_ok=True)
            tok.save(path)
    return PreTrainedTokenizerFast(tokenizer_file=path, eos_token="<|endoftext|>")


def summary(samples_us: list) -> str:
    s = sorted(samples_us)
    return (f"mean {statistics.fmean(s):7.1f}  p50 {s[len(s) // 2]:7.1f}  "
            f"p95 {s[int(0.95 * (len(s) - 1))]:7.1f} us")


def bench_llguidance(hf, grammars, repeats: int):
    from importlib.metadata import version

    print(f"\n== llguidance {version('llguidance')} on {len(hf)} tokens (logits width {grammars.vocab_size})")
    for name, (schema, value) in CASES.items():
        fmt = {"type": "json_schema", "json_schema": {"schema": schema}}
        ids = hf.encode(layout(value), add_special_tokens=False) + [hf.eos_token_id]
        tic = time.perf_counter()
        grammars.compile(fmt)
        first = time.perf_counter() - tic
        tic = time.perf_counter()
        grammars.compile(fmt)
        again = time.perf_counter() - tic
        raw, dev, verify = [], [], []
        for _ in range(repeats):
            g = grammars.compile(fmt)
            for t in ids:
                a = time.perf_counter()
                g.bitmasks([])
                b = time.perf_counter()
                mx.eval(g.masks([]))
                c = time.perf_counter()
                g.advance([t])
                d = time.perf_counter()
                raw.append((b - a) * 1e6)
                dev.append((d - b) * 1e6)
            g = grammars.compile(fmt)
            for i in range(0, len(ids) - 5, 5):  # rounds of 4 drafts, all accepted, then the bonus token
                a = time.perf_counter()
                mx.eval(g.masks(ids[i : i + 4]))
                verify.append((time.perf_counter() - a) * 1e6 / 5)
                g.advance(ids[i : i + 5])
        print(f"{name:7s} {len(ids):3d} tokens; compile {first * 1e3:6.1f} ms (cached {again * 1e3:.2f} ms)")
        print(f"  bitmask alone           {summary(raw)}")
        print(f"  [1,V] mask + advance    {summary(dev)}")
        print(f"  verify K=4, per position {summary(verify)}")


def bench_outlines(hf, repeats: int):
    try:
        import outlines_core
        from outlines_core import Guide, Index, Vocabulary
        from outlines_core.json_schema import build_regex_from_schema
    except ImportError:
        print("\n(outlines-core not installed: skipped)")
        return
    from tokenizers import pre_tokenizers  # noqa: F401

    from importlib.metadata import version

    print(f"\n== outlines-core {version('outlines-core')} on {len(hf)} tokens")
    byte_of = {c: b for b, c in _bytes_to_unicode().items()}
    eos = hf.eos_token_id
    mapping: dict = {}
    for tok, i in hf.get_vocab().items():
        if i == eos:
            continue
        raw = bytes(byte_of[c] for c in tok) if all(c in byte_of for c in tok) else tok.encode()
        mapping.setdefault(raw, []).append(i)
    tic = time.perf_counter()
    vocab = Vocabulary(eos, mapping)
    print(f"vocabulary: {time.perf_counter() - tic:.2f} s")
    for name, (schema, value) in CASES.items():
        regex = build_regex_from_schema(json.dumps(schema), whitespace_pattern=r"[ ]?")
        tic = time.perf_counter()
        try:
            index = Index(regex, vocab)
        except Exception as e:  # noqa: BLE001 - a figure, not a failure
            print(f"{name:7s} index failed: {str(e)[:80]}")
            continue
        built = time.perf_counter() - tic
        ids = hf.encode(layout(value), add_special_tokens=False) + [eos]
        mask = np.zeros(((len(hf) + 31) // 32,), dtype=np.int32)
        per = []
        for _ in range(repeats):
            guide = Guide(index)
            for t in ids:
                a = time.perf_counter()
                guide.write_mask_into(mask.ctypes.data, mask.size, mask.itemsize)
                if t != eos:
                    guide.advance(t)
                per.append((time.perf_counter() - a) * 1e6)
        print(f"{name:7s} index build {built:7.2f} s; per token mask + advance {summary(per)}")


def _bytes_to_unicode() -> dict:
    """GPT-2's byte -> printable character map (what byte-level BPE tokens are spelled in)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def bench_processors(hf, grammars, repeats: int):
    print(f"\n== processors per round, logits [K+1, {VOCAB}] float32: ms per call, median of {repeats}"
          " (controls interleaved; 'none' is the normalization every round pays)")
    rng = np.random.default_rng(0)
    history = rng.integers(0, VOCAB, 2000).tolist()
    schema, value = CASES["nested"]
    doc = hf.encode(layout(value), add_special_tokens=False)
    controls = {
        "none": dict(),
        "logit_bias(10)": dict(logit_bias={int(t): 1.0 for t in rng.integers(0, VOCAB, 10)}),
        "repetition": dict(repetition_penalty=1.1),
        "presence": dict(presence_penalty=0.5),
        "frequency": dict(frequency_penalty=0.5),
        "frequency(ctx 0)": dict(frequency_penalty=0.5, frequency_context_size=0),
        "all four": dict(logit_bias={5: 1.0}, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5),
        "grammar": None,
    }
    figures = {name: {} for name in controls}
    for k in (0, 4, 8):
        logits = mx.random.normal((k + 1, VOCAB), key=mx.random.key(k))
        mx.eval(logits)
        calls = {}
        for name, kw in controls.items():
            if kw is None:
                g = grammars.compile({"type": "json_schema", "json_schema": {"schema": schema}})
                g.advance(doc[:10])
                procs, drafts = make_processors(vocab_size=VOCAB, grammar=g), doc[10 : 10 + k]
            else:
                procs, drafts = make_processors(vocab_size=VOCAB, **kw), rng.integers(0, VOCAB, k).tolist()
            calls[name] = (lambda p=procs, d=drafts: mx.eval(p.process(logits, history, d)))
        times = {name: [] for name in controls}
        names = list(controls)
        for r in range(repeats + 2):
            for name in names[r % len(names):] + names[: r % len(names)]:
                a = time.perf_counter()
                calls[name]()
                if r >= 2:
                    times[name].append((time.perf_counter() - a) * 1e3)
        for name in controls:
            figures[name][k] = statistics.median(times[name])
    print(f"{'control':18s}" + "".join(f"{'K=' + str(k):>10s}" for k in (0, 4, 8)))
    for name, row in figures.items():
        print(f"{name:18s}" + "".join(f"{row[k]:10.3f}" for k in (0, 4, 8)))
    print(f"\n== sampler distribution per round, [K+1, {VOCAB}] (ms)")
    for name, s in (("temp", Sampler(0.8)), ("top_p+top_k", Sampler(0.8, top_p=0.9, top_k=40)),
                    ("min_p", Sampler(0.8, min_p=0.05)), ("xtc", Sampler(0.8, xtc_probability=0.5))):
        row = []
        for k in (0, 4, 8):
            lp = mx.random.normal((k + 1, VOCAB), key=mx.random.key(k))
            mx.eval(lp)
            times = []
            for _ in range(repeats + 2):
                a = time.perf_counter()
                mx.eval(s.probs(lp))
                times.append((time.perf_counter() - a) * 1e3)
            row.append(statistics.median(times[2:]))
        print(f"{name:18s}" + "".join(f"{t:10.3f}" for t in row))
    print(f"\n== the keyed match's draws per round: Sampler.sample_positions on [K+1, {VOCAB}] (ms)")
    for name, s in (("temp", Sampler(0.8)), ("top_p+top_k", Sampler(0.8, top_p=0.9, top_k=40)),
                    ("xtc", Sampler(0.8, xtc_probability=0.5))):
        row = []
        for k in (0, 4, 8):
            lp = mx.random.normal((k + 1, VOCAB), key=mx.random.key(k))
            mx.eval(lp)
            times = []
            for _ in range(repeats + 2):
                a = time.perf_counter()
                mx.eval(s.sample_positions(lp, Keys(0))[0])
                times.append((time.perf_counter() - a) * 1e3)
            row.append(statistics.median(times[2:]))
        print(f"{name:18s}" + "".join(f"{t:10.3f}" for t in row))


# -- 3. the engine with each control -----------------------------------------------------------

DECODE_CONTROLS = {
    "off (greedy)": {},
    "penalties": dict(repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.3),
    "logit_bias": dict(logit_bias={"30": 1.5, "31": -1.0, "262": 0.5}),
    "sampling": dict(temperature=0.8, top_p=0.95, top_k=50, min_p=0.05, seed=1),
    "xtc": dict(temperature=0.8, xtc_probability=0.5, xtc_threshold=0.1, seed=1),
    "json_schema": dict(response_format={"type": "json_schema", "json_schema": {"schema": {
        **OBJ, "properties": {"items": {"type": "array", "maxItems": 40, "items": {
            **OBJ, "properties": {"sku": {"type": "string", "maxLength": 12}, "qty": {"type": "integer"}},
            "required": ["sku", "qty"]}}}, "required": ["items"]}}}),
}


def _serve(engine, reqs) -> tuple[float, int, float]:
    """Run `reqs` to the end on `engine`: (seconds of decoding, tokens generated, seconds in all).
    Decoding starts when every request has its first token (the prompts' prefill is not counted)
    and its token is not counted either."""
    from segcache.serve.engine import Chunk, Finish
    from segcache.serve.worker import Job, Scheduler

    sched = Scheduler(engine, max_running=engine.decode_concurrency, begin_step=engine.begin_step)
    done, first = [], {}

    def deliver(rid):
        def put(e):
            if isinstance(e, Chunk) and e.text and (rid, e.index) not in first:
                first[rid, e.index] = time.perf_counter()
            if isinstance(e, Finish):
                done.append(e)
        return put

    for r in reqs:
        sched.submit(Job(r, deliver(r.id)))
    tic = time.perf_counter()
    while sched.step():
        pass
    end = time.perf_counter()
    tokens = sum(f.usage.completion_tokens for f in done) - len(first)
    return end - max(first.values()), tokens, end - tic


def bench_decode(repeats: int) -> None:
    from segcache.controls import Controls
    from segcache.demo import MODELS_DIR
    from segcache.serve.engine import Engine, GenRequest

    target, tok = mlx_lm.load(str(MODELS_DIR / "target"))
    draft, _ = mlx_lm.load(str(MODELS_DIR / "draft"))
    text = open(MODELS_DIR / "heldout_stdlib.txt").read()
    prompts = [tok.encode(text[i * 3000: i * 3000 + 1200]) for i in range(8)]
    max_tokens = 128
    modes = {"plain": {}, "lookup": dict(prompt_lookup=True), "draft": dict(draft_model=draft)}
    print(f"\n== the engine on the shipped target: tok/s, {max_tokens} tokens per row, prompts ~{len(prompts[0])} "
          f"tokens, median of {repeats} (greedy unless the control samples)")
    table = {}
    for rows in (1, 8):
        engines = {m: Engine(target, tok, decode_concurrency=rows, **kw) for m, kw in modes.items()}
        for e in engines.values():
            e.warm_up()
        for name, fields in DECODE_CONTROLS.items():
            samples = {m: [] for m in modes}
            for rep in range(repeats + 1):
                order = list(modes)[rep % 3:] + list(modes)[:rep % 3]  # interleaved: load hits each alike
                for m in order:
                    reqs = [GenRequest(f"{name}-{m}-{rep}-{i}", prompts[i], max_tokens,
                                       controls=Controls(**fields)) for i in range(rows)]
                    secs, toks, _ = _serve(engines[m], reqs)
                    if rep:  # the first round warms the grammar, the processors, the shapes
                        samples[m].append(toks / secs)
            table[rows, name] = {m: statistics.median(v) for m, v in samples.items()}
        print(f"\n{rows} row(s)        " + "".join(f"{m:>10}" for m in modes) + "   lookup x   draft x")
        for name in DECODE_CONTROLS:
            t = table[rows, name]
            print(f"  {name:<14}" + "".join(f"{t[m]:>10.0f}" for m in modes)
                  + f"{t['lookup'] / t['plain']:>10.2f}{t['draft'] / t['plain']:>10.2f}")
        base = table[rows, "off (greedy)"]
        for name in ("penalties", "logit_bias", "json_schema"):
            t = table[rows, name]
            kept = {m: (t[m] / t["plain"]) / (base[m] / base["plain"]) for m in ("lookup", "draft")}
            verdict = "ok" if min(kept.values()) >= 0.9 else "below 90%"
            print(f"  speed-up kept with {name}: lookup {kept['lookup']:.0%}, draft {kept['draft']:.0%} "
                  f"(speculative x with it / x without; target >= 90%: {verdict})")
    bench_choices(target, tok, prompts[0] * 1, repeats)


def bench_choices(model, tok, prompt, repeats: int) -> None:
    from segcache.serve.engine import Engine, GenRequest

    print(f"\n== n choices of one request vs n requests (prompt {len(prompt)} tokens, 32 tokens each, "
          f"temperature 1, batched rows, no store): seconds and peak memory above the model, median of {repeats}")
    base = None
    for n in (1, 4, 8):
        engine = Engine(model, tok, decode_concurrency=n)
        engine.warm_up()
        rows = {}
        for how in ("n choices", "n requests"):
            secs, peaks = [], []
            for rep in range(repeats):
                reqs = ([GenRequest(f"c{rep}", prompt, 32, temperature=1.0, seed=rep, n=n)] if how == "n choices"
                        else [GenRequest(f"r{rep}-{i}", prompt, 32, temperature=1.0, seed=rep + i) for i in range(n)])
                mx.synchronize()
                mx.clear_cache()
                base = mx.get_active_memory()
                mx.reset_peak_memory()
                _, _, t = _serve(engine, reqs)  # prefill included: that is what n choices share
                secs.append(t)
                peaks.append(mx.get_peak_memory() - base)
            rows[how] = (statistics.median(secs), statistics.median(peaks))
        (a, ma), (b, mb) = rows["n choices"], rows["n requests"]
        print(f"  n={n}: choices {a:.3f} s, {ma / 2**20:.1f} MiB   requests {b:.3f} s, {mb / 2**20:.1f} MiB   "
              f"time x{b / a:.2f}, memory x{mb / max(ma, 1):.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--tokenizer", help="a tokenizer.json of ~150k tokens (default: train one)")
    parser.add_argument("--skip-outlines", action="store_true", help="leave out outlines-core (minutes of index builds)")
    parser.add_argument("--decode", action="store_true", help="only the engine's tok/s with each control (3.)")
    args = parser.parse_args()
    repeats = 3 if args.quick else 10
    if args.decode:
        print(f"segcache bench/sampling --decode  python {sys.version.split()[0]}  mlx {mx.__version__}  "
              f"BLAS {__import__('segcache').BLAS}")
        bench_decode(3 if args.quick else 5)
        return
    print(f"segcache bench/sampling  python {sys.version.split()[0]}  mlx {mx.__version__}  "
          f"BLAS {__import__('segcache').BLAS}")
    hf = bpe_tokenizer(args.tokenizer)
    tic = time.perf_counter()
    grammars = Grammars(hf, max(VOCAB, len(hf)))
    print(f"llguidance tokenizer setup (once per model): {time.perf_counter() - tic:.2f} s")
    bench_llguidance(hf, grammars, repeats)
    if not args.skip_outlines:
        bench_outlines(hf, max(1, repeats // 3))
    bench_processors(hf, grammars, repeats)


if __name__ == "__main__":
    main()
