"""`segcache check`: the property harness run on a user's model, mlx-lm's own caches the reference.

    subject = load("~/models/x", draft_path=None)     # as `segcache serve` loads it; refuses first
    for result in run(subject, budget_for(subject), seed=0):
        ...                                            # one Result per property, as it finishes

Properties (PROPERTIES, in this order; docs/check.md says what each covers and cannot):

* runtime - `RuntimeMachine`: fork / forward / commit / rollback / clone / failed
  forwards / direct model calls / speculative rounds, every forward's logits against
  mlx-lm's cache;
* batch - `BatchMachine`: rows joining and leaving, ragged speculative rounds and
  per-row commits (skipped, with mlx-lm's reason, where the family is not batched);
* store - `StoreMachine`: the runtime's programs with publish / resume / evict /
  reopen / damage on a temporary prefix store;
* speculative: prompt lookup / draft model / MTP head - greedy tokens identical to
  `mlx_lm.stream_generate` (the draft model when given, the MTP head when the model
  has one, else skipped).

Budgets (`budget_for`) follow the size of the weights on disk, so a seed gives the
same programs on every machine (a report reproduces): with
scale = min(1, sqrt(REFERENCE_BYTES / weight bytes)), each property runs
max(FLOOR, round(BASE * scale)) examples, and the contexts, prompts and generations
are their full length times sqrt(scale), down to a floor. A sliding window of at most
CROSSED_WINDOW tokens stretches the contexts past it. The first failure ends the run (`run`).
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import mlx.core as mx
import mlx_lm
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as use_seed
from hypothesis import strategies as st
from hypothesis.database import InMemoryExampleDatabase
from hypothesis.internal.conjecture import engine as hypothesis_engine
from hypothesis.stateful import run_state_machine_as_test
from mlx.utils import tree_flatten
from mlx_lm.models.cache import CacheList, RotatingKVCache, make_prompt_cache
from mlx_lm.utils import hf_repo_to_path

from . import dropin
from .batch import BatchRuntime
from .serve.paths import shown
from .errors import ModelError, SegcacheError, UnsupportedModelError
from .generation import stream_generate
from .mtp import head_for
from .runtime import Runtime
from .testing.batch_machine import BatchMachine
from .testing.program import Stepper, render
from .testing.statemachine import RuntimeMachine
from .testing.store_machine import StoreMachine

PROPERTIES = (
    "runtime",
    "batch",
    "store",
    "speculative: prompt lookup",
    "speculative: draft model",
    "speculative: MTP head",
)

REFERENCE_BYTES = 64 << 20  # weights up to this size get the full budget (the shipped target: 14 MB)
BASE = {"runtime": 60, "batch": 20, "store": 25, "speculative": 15}  # examples at scale 1
FLOOR = {"runtime": 8, "batch": 3, "store": 4, "speculative": 4}  # examples at any scale
STEPS = 20  # steps per state-machine program
CONTEXT, PROMPT, GENERATE = 48, 48, 24  # tokens a program reaches, a speculative prompt, a generation
MIN_CONTEXT, MIN_PROMPT, MIN_GENERATE = 16, 16, 8
CROSSED_WINDOW = 128  # a sliding window this short is crossed: contexts reach past it
MAX_CALLS = 5  # a shrunk program longer than this gets more shrinking passes
SHRINK_PASSES = 2
SHRINK_SECONDS = 10  # per shrinking pass at scale 1, SHRINK_SECONDS / scale beyond (at most MAX_SHRINK_SECONDS)
MAX_SHRINK_SECONDS = 120  # hypothesis's own limit is 300 s: long for a command
MEMORY_HEADROOM = 1.25  # the weights, plus caches, the references and the store's RAM tier
MEMORY_SLACK = 512 << 20

# (atol, rtol, margin, batch atol) of the logits against mlx-lm's, per compute dtype: bit-exact where
# the same kernels run, but a reference rebuilt in one block rounds otherwise than chunks did (and
# batched products otherwise than single rows: the batch atol, absolute); greedy tokens must agree
# wherever the reference's top two are `margin` apart. float32 is what the test suite asks.
TOLERANCES = {
    mx.float32: (1e-4, 1e-4, 1e-3, 1e-4),
    mx.float16: (2e-2, 1e-2, 1e-1, 2.5e-1),
    mx.bfloat16: (1e-1, 2e-2, 5e-1, 1.0),
}


@dataclass(frozen=True)
class Budget:
    """How much each property runs (see the module docstring for the rule)."""

    scale: float
    examples: dict  # property group ("runtime", "batch", "store", "speculative") -> examples
    steps: int
    context: int  # tokens a runtime / store program reaches at most
    prompt: int  # longest speculative prompt
    generate: int  # most tokens a speculative example generates
    batch_prompt: int  # longest prompt a batch row joins with
    batch_chunk: int  # longest forward of a batch row
    window: Optional[int]  # the shortest sliding window, if the model has one
    shrink_seconds: float  # how long one shrinking pass of a failure may take


@dataclass
class Subject:
    """A model loaded as `segcache serve` loads it, with what the properties need to know of it."""

    path: str
    model: object
    tokenizer: object
    family: str
    dtype: object
    weight_bytes: int
    vocab: int
    window: Optional[int]
    quantization: str = ""  # e.g. "4-bit", from the config mlx_lm.convert wrote
    draft_path: Optional[str] = None
    draft: object = None
    head: object = None
    head_reason: str = ""  # why there is no MTP head
    batch_reason: str = ""  # why the family is not batched

    @property
    def tolerances(self) -> tuple:
        return TOLERANCES.get(self.dtype, TOLERANCES[mx.float16])


@dataclass
class Result:
    """One property's outcome: status "pass", "fail", "skip" (saying why) or "not run" (after a failure)."""

    name: str
    status: str
    examples: int = 0
    seconds: float = 0.0
    detail: str = ""  # why skipped, or what failed
    program: list = field(default_factory=list)  # the shrunk counterexample, lines of Python
    calls: int = 0  # calls the program makes

    def as_dict(self) -> dict:
        return {**asdict(self), "seconds": round(self.seconds, 3)}


# -- sizes and memory ----------------------------------------------------------------------


def model_dir(path: str) -> Path:
    """The local directory of `path` (a Hugging Face repo resolves to its snapshot, as mlx_lm.load does)."""
    local = Path(path).expanduser()
    if local.is_dir():
        return local
    try:  # a repo id: this may download, as loading would
        return Path(hf_repo_to_path(path))
    except Exception as exc:  # the hub raises many types for a missing or private repo
        raise ModelError(f"cannot find the model {path!r}: no such directory, and not a Hugging Face repo "
                         f"({exc})") from exc


def weight_bytes(directory: Path) -> int:
    """Bytes of the safetensors weights in `directory`."""
    return sum(f.stat().st_size for f in Path(directory).glob("*.safetensors"))


def memory() -> tuple[int, int]:
    """(available, total) bytes of memory for the model: Metal's working set, else the system's."""
    if mx.metal.is_available():
        info = mx.device_info()
        total = int(info.get("memory_size", 0))
        return int(info.get("max_recommended_working_set_size", total)), total
    try:
        with open("/proc/meminfo") as f:
            fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return fields["MemAvailable"], fields["MemTotal"]
    except (OSError, KeyError, ValueError, IndexError):
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return total, total


def _size(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def refuse_if_too_large(sizes: dict) -> None:
    """Raise ModelError, with the numbers, when the weights cannot fit in memory with the check's own.

    Args:
        sizes: what is loaded (e.g. "the model at ~/x") -> bytes of its weights.
    """
    weights = sum(sizes.values())
    need = int(weights * MEMORY_HEADROOM) + MEMORY_SLACK
    available, total = memory()
    if need > available:
        parts = ", ".join(f"{what}: {_size(n)}" for what, n in sizes.items())
        raise ModelError(
            f"too large for this machine: the check needs about {_size(need)} ({parts} of weights, times "
            f"{MEMORY_HEADROOM} for caches and mlx-lm's reference caches, plus {_size(MEMORY_SLACK)}), but "
            f"{_size(available)} of {_size(total)} is available; nothing was loaded. Free memory, check a "
            "quantized conversion (mlx_lm.convert -q), or run on a machine with more memory"
        )


# -- the subject ---------------------------------------------------------------------------


def compute_dtype(model) -> object:
    """The floating dtype most of the model's floating parameters have (a quantized model's scales')."""
    counts = Counter()
    for _, w in tree_flatten(model.parameters()):
        if mx.issubdtype(w.dtype, mx.floating):
            counts[w.dtype] += w.size
    return counts.most_common(1)[0][0] if counts else mx.float32


def shortest_window(model) -> Optional[int]:
    """The shortest sliding window among the model's caches (None without one)."""
    def flat(caches):
        for c in caches:
            yield from flat(c.caches) if isinstance(c, CacheList) else (c,)

    sizes = [c.max_size for c in flat(make_prompt_cache(model)) if isinstance(c, RotatingKVCache)]
    return min(sizes) if sizes else None


def _vocab(model, config: dict) -> int:
    text = config.get("text_config") or {}
    vocab = config.get("vocab_size") or text.get("vocab_size")
    if vocab:
        return int(vocab)
    return int(model.model.embed_tokens.weight.shape[0])


def _quantization(config: dict) -> str:
    q = config.get("quantization") or {}
    return f"{q['bits']}-bit" if isinstance(q, dict) and q.get("bits") else ""


def _supported(model, what: str) -> None:
    """Raise UnsupportedModelError naming `what` and its layer where segcache cannot branch `model`."""
    try:
        Runtime(model, gdn_prefill="auto")  # as segcache serve builds it: an unsupported layer raises here
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(f"{what}: {exc}") from None


def load(path: str, draft_path: Optional[str] = None) -> Subject:
    """The model (and draft) as `segcache serve` loads them, after refusing what cannot fit.

    Raises:
        ModelError: a model cannot be found or loaded, does not fit in memory, or the draft's
            vocabulary differs from the model's.
        UnsupportedModelError: segcache cannot branch the model (names the layer and its cache).
    """
    where = model_dir(path)
    sizes = {f"the model at {shown(where)}": weight_bytes(where)}
    draft_where = None
    if draft_path is not None:
        draft_where = model_dir(draft_path)
        sizes[f"the draft at {shown(draft_where)}"] = weight_bytes(draft_where)
    refuse_if_too_large(sizes)
    model, tokenizer, config = dropin.load(str(where))
    _supported(model, f"the model at {shown(where)}")
    local = Path(path).expanduser()
    subject = Subject(
        path=str(local) if local.is_dir() else str(path),  # as a pasted program loads it again
        model=model, tokenizer=tokenizer, family=config.get("model_type", type(model).__module__),
        dtype=compute_dtype(model), weight_bytes=sizes[next(iter(sizes))], vocab=_vocab(model, config),
        window=shortest_window(model), quantization=_quantization(config),
    )
    if draft_where is not None:
        draft, _, draft_config = dropin.load(str(draft_where), what="draft model")
        _supported(draft, f"the draft model at {shown(draft_where)}")
        if _vocab(draft, draft_config) != subject.vocab:
            raise ModelError(f"the draft model's vocabulary ({_vocab(draft, draft_config)}) differs from the "
                             f"model's ({subject.vocab}); the draft must share its tokenizer")
        local = Path(draft_path).expanduser()
        subject.draft, subject.draft_path = draft, str(local) if local.is_dir() else str(draft_path)
    try:
        subject.head = head_for(model, str(where))
    except SegcacheError as exc:  # no head in the directory, or a family without one
        subject.head_reason = str(exc)
    try:
        BatchRuntime(model)
    except UnsupportedModelError as exc:
        subject.batch_reason = str(exc)
    return subject


def budget_for(subject: Subject, examples: Optional[int] = None) -> Budget:
    """The budget for `subject`'s size; `examples` (if given) for every property instead."""
    scale = min(1.0, math.sqrt(REFERENCE_BYTES / max(subject.weight_bytes, 1)))
    counts = {k: examples if examples else max(FLOOR[k], round(BASE[k] * scale)) for k in BASE}
    length = math.sqrt(scale)
    context = max(MIN_CONTEXT, round(CONTEXT * length))
    batch_prompt, batch_chunk = 6, 4  # BatchMachine's defaults
    window = subject.window
    if window is not None and window <= CROSSED_WINDOW:
        context = max(context, 2 * window + 8)
        batch_prompt, batch_chunk = 2 * window + 4, window + 2
    return Budget(
        scale=scale, examples=counts, steps=STEPS, context=context,
        prompt=max(MIN_PROMPT, round(PROMPT * length)), generate=max(MIN_GENERATE, round(GENERATE * length)),
        batch_prompt=batch_prompt, batch_chunk=batch_chunk, window=window,
        shrink_seconds=min(MAX_SHRINK_SECONDS, SHRINK_SECONDS / scale),
    )


# -- the machines bound to the subject ------------------------------------------------------


def machine_class(kind: str, subject: Subject, budget: Budget, store_dir: Optional[str] = None) -> type:
    """The state machine of `kind` ("runtime", "batch", "store") bound to the subject, as `run` runs it."""
    atol, rtol, margin, batch_atol = subject.tolerances
    common = {"model": subject.model, "vocab": subject.vocab}
    if kind == "batch":
        attrs = dict(common, prompt=budget.batch_prompt, chunk=budget.batch_chunk, atol=batch_atol)
        return type("BatchMachine_check", (BatchMachine,), attrs)
    attrs = dict(common, max_tokens=budget.context, atol=atol, rtol=rtol, margin=margin)
    attrs["gdn_prefill"] = "auto"  # as segcache serve runs Gated DeltaNet prompt blocks
    if kind == "runtime":
        return type("RuntimeMachine_check", (RuntimeMachine,), attrs)
    if kind == "store":
        return type("StoreMachine_check", (StoreMachine,), dict(attrs, root=store_dir))
    raise ValueError(f"unknown machine {kind!r}; choose runtime, batch or store")


def machine(kind: str, path: str) -> Stepper:
    """A fresh machine of `kind` on the model at `path`, as `segcache check` built it, for replaying a
    printed counterexample (each call is followed by the machine's invariants)."""
    subject = load(path)
    return Stepper(machine_class(kind, subject, budget_for(subject))())


# every phase but `explain`: it reruns the failure to annotate it, which costs time and edits the program's lines
PHASES = (Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink)


def _settings(examples: int, db, phases=PHASES, steps: int = STEPS) -> settings:
    return settings(
        max_examples=examples, stateful_step_count=steps, deadline=None, database=db, phases=phases,
        suppress_health_check=list(HealthCheck), verbosity=Verbosity.normal, report_multiple_bugs=False,
        print_blob=False,
    )


@contextlib.contextmanager
def _quiet():
    """Hypothesis and mlx-lm print as they go; the command prints the results itself."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


def _summary(exc: BaseException) -> str:
    inner = getattr(exc, "exceptions", None)  # an ExceptionGroup of a flaky failure
    if inner:
        exc = inner[0]
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _run_machine(kind: str, name: str, subject: Subject, budget: Budget, seed: int,
                 store_dir: Optional[str]) -> Result:
    base = machine_class(kind, subject, budget, store_dir)
    runs = [0]

    def counted_init(self):
        runs[0] += 1
        base.__init__(self)

    counted = use_seed(seed)(type(base.__name__, (base,), {"__init__": counted_init}))
    examples = budget.examples[kind]
    db = InMemoryExampleDatabase()
    start = time.perf_counter()
    failure = _attempt(counted, _settings(examples, db, steps=budget.steps), budget.shrink_seconds)
    if failure is None:
        return Result(name, "pass", runs[0], time.perf_counter() - start)
    construct = f"state = check.machine({kind!r}, {subject.path!r})"
    program, calls = render(getattr(failure, "__notes__", []), base, construct)
    for _ in range(SHRINK_PASSES):  # more shrinking from the stored counterexample, while it is long
        if calls <= MAX_CALLS:
            break
        again = _attempt(counted, _settings(examples, db, phases=(Phase.reuse, Phase.shrink), steps=budget.steps),
                         budget.shrink_seconds)
        if again is None:
            break
        shorter, fewer = render(getattr(again, "__notes__", []), base, construct)
        if fewer >= calls:
            break
        failure, program, calls = again, shorter, fewer
    preamble = ["from segcache import check", "from segcache.testing.program import drawn"]
    return Result(name, "fail", runs[0], time.perf_counter() - start, _summary(failure),
                  preamble + program + [f"# -> {_summary(failure)}"], calls)


def _attempt(machine: type, cfg: settings, shrink_seconds: float) -> Optional[BaseException]:
    try:
        with _quiet(), _shrink_limit(shrink_seconds):
            run_state_machine_as_test(machine, settings=cfg)
    except Exception as exc:  # any failure of a program is the property's
        return exc
    return None


@contextlib.contextmanager
def _shrink_limit(seconds: float):
    """Hypothesis shrinks for up to MAX_SHRINKING_SECONDS (no setting names it): bound it here."""
    saved = hypothesis_engine.MAX_SHRINKING_SECONDS
    hypothesis_engine.MAX_SHRINKING_SECONDS = seconds
    try:
        yield
    finally:
        hypothesis_engine.MAX_SHRINKING_SECONDS = saved


def _speculative(name: str, subject: Subject, budget: Budget, seed: int, drafter: dict, setup: list) -> Result:
    """Greedy tokens with `drafter` (stream_generate's arguments) identical to mlx_lm.stream_generate."""
    model, tokenizer = subject.model, subject.tokenizer
    ids = st.integers(0, subject.vocab - 1)
    third = max(1, budget.prompt // 3)
    margin = subject.tolerances[2]
    runs, ties, failed = [0], [0], {}

    @use_seed(seed)
    @_settings(budget.examples["speculative"], InMemoryExampleDatabase())
    @given(seg=st.lists(ids, min_size=1, max_size=third), reps=st.integers(1, 3),
           tail=st.lists(ids, max_size=third), max_tokens=st.integers(1, budget.generate), k=st.integers(1, 4))
    def identical(seg, reps, tail, max_tokens, k):
        runs[0] += 1
        prompt = (seg * reps + tail)[: budget.prompt]
        want = [r.token for r in mlx_lm.stream_generate(model, tokenizer, mx.array(prompt), max_tokens=max_tokens)]
        got = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens,
                                                num_draft_tokens=k, **drafter)]
        if got == want:
            return
        i = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        if i < min(len(got), len(want)):
            cache = make_prompt_cache(model)
            logits = model(mx.array(prompt + want[:i])[None], cache=cache)[0, -1].astype(mx.float32)
            if abs((logits[want[i]] - logits[got[i]]).item()) <= margin:
                ties[0] += 1  # a near tie: either token is greedy within the dtype's rounding
                return
        failed.update(prompt=prompt, max_tokens=max_tokens, k=k, got=got, want=want, at=i)
        raise AssertionError(f"token {i} of {len(want)}: {got[i] if i < len(got) else 'none'} where mlx-lm "
                             f"gives {want[i] if i < len(want) else 'none'}")

    start = time.perf_counter()
    try:
        with _quiet(), _shrink_limit(budget.shrink_seconds):
            identical()
    except Exception as exc:  # any failure of an example is the property's
        seconds = time.perf_counter() - start
        if not failed:
            return Result(name, "fail", runs[0], seconds, _summary(exc))
        f = failed
        options = "".join(f", {key}={value}" for key, value in _drafter_source(drafter).items())
        program = [
            "import mlx.core as mx, mlx_lm, segcache",
            f"model, tokenizer = mlx_lm.load({subject.path!r})",
            *setup,
            f"prompt = {f['prompt']!r}",
            f"want = [r.token for r in mlx_lm.stream_generate(model, tokenizer, mx.array(prompt), "
            f"max_tokens={f['max_tokens']})]",
            f"got = [r.token for r in segcache.stream_generate(model, tokenizer, prompt, "
            f"max_tokens={f['max_tokens']}, num_draft_tokens={f['k']}{options})]",
            "assert got == want, (got, want)",
            f"# -> got {f['got']}, want {f['want']} (first difference at token {f['at']})",
        ]
        return Result(name, "fail", runs[0], seconds, _summary(exc), program, 2)
    detail = f"{ties[0]} near ties within the {subject.dtype} margin {margin}" if ties[0] else ""
    return Result(name, "pass", runs[0], time.perf_counter() - start, detail)


def _drafter_source(drafter: dict) -> dict:
    """The drafter's arguments as they read in a pasted program."""
    names = {"prompt_lookup": "True", "draft_model": "draft", "mtp": "head"}
    return {key: names[key] for key in drafter}


# -- the run -------------------------------------------------------------------------------


def run(subject: Subject, budget: Budget, *, seed: int = 0, store_dir: Optional[str] = None) -> Iterator[Result]:
    """Run every property on `subject`, yielding each one's Result as it finishes (PROPERTIES' order).

    The first failure ends the run: the properties after it build on what failed, so they are
    yielded as "not run" (their counterexamples would be the same bug, and slow to shrink).

    Args:
        store_dir: the directory the store property's temporary stores are made in (each
            removed after its program); None for the system's temporary directory.
    """
    if store_dir is not None:
        Path(store_dir).mkdir(parents=True, exist_ok=True)
    failed = None
    for name, check in _properties(subject, budget, seed, store_dir):
        if failed is not None:
            yield Result(name, "not run", detail=f"{failed} failed first (its counterexample is the one to fix)")
            continue
        result = check()
        if result.status == "fail":
            failed = name
        yield result


def _properties(subject: Subject, budget: Budget, seed: int, store_dir: Optional[str]) -> list:
    """(name, thunk giving its Result) per property, in PROPERTIES' order: the lower floors first."""
    def skip(name, why):
        return name, lambda: Result(name, "skip", detail=why)

    def machine_run(kind, name):
        return name, lambda: _run_machine(kind, name, subject, budget, seed, store_dir)

    def speculative(name, drafter, setup):
        return name, lambda: _speculative(name, subject, budget, seed, drafter, setup)

    path = subject.path
    return [
        machine_run("runtime", PROPERTIES[0]),
        skip(PROPERTIES[1], f"not batched: {subject.batch_reason}") if subject.batch_reason
        else machine_run("batch", PROPERTIES[1]),
        machine_run("store", PROPERTIES[2]),
        speculative(PROPERTIES[3], {"prompt_lookup": True}, []),
        skip(PROPERTIES[4], "no --draft-model given") if subject.draft is None
        else speculative(PROPERTIES[4], {"draft_model": subject.draft},
                         [f"draft, _ = mlx_lm.load({subject.draft_path!r})"]),
        skip(PROPERTIES[5], subject.head_reason) if subject.head is None
        else speculative(PROPERTIES[5], {"mtp": subject.head},
                         ["from segcache.mtp import head_for", f"head = head_for(model, {path!r})"]),
    ]

