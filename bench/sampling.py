"""Sampling controls and structured output: what they cost per token and per round.

1. Structured output on a ~150k-token byte-level BPE vocabulary: grammar
   compile time, and per token the mask (llguidance's bitmask alone, then
   segcache's [1, V] bool mask on the device) plus the advance; per verify
   round of K=4 drafts, the K+1 masks. outlines-core (an up-front index per
   schema) runs beside it when installed, for the choice of engine.
2. Processors per round: `Processors.process` on a verify's logits [K+1, V]
   (V = 151936, K = 0, 4, 8) for each control, and the sampler's distribution.

The vocabulary: `--tokenizer PATH` (a tokenizer.json), else a byte-level BPE
of 150k tokens trained once on the Python sources installed here (~3 min on
2 cores), cached under ~/.cache/segcache/bench/.

    python bench/sampling.py [--quick] [--tokenizer PATH] [--skip-outlines]
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
import numpy as np

from segcache.grammar import Grammars
from segcache.processors import make_processors
from segcache.sampling import Sampler

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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--tokenizer", help="a tokenizer.json of ~150k tokens (default: train one)")
    parser.add_argument("--skip-outlines", action="store_true", help="leave out outlines-core (minutes of index builds)")
    args = parser.parse_args()
    repeats = 3 if args.quick else 10
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
