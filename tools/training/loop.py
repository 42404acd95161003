"""The training loop every stage shares: its schedules, its compiled step and its summary."""

from __future__ import annotations

import time
from functools import partial
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

WSD = ("warmup-stable-decay: linear warmup from 1% of peak, constant, "
       "linear cooldown to 10% of peak")


def batch_iterator(tokens: np.ndarray, batch: int, seq_len: int, seed: int):
    """Yields ``(inputs, targets)`` from random windows of the token stream."""
    rng = np.random.default_rng(seed)
    high = len(tokens) - seq_len - 1
    while True:
        starts = rng.integers(0, high, size=batch)
        windows = np.stack([tokens[s : s + seq_len + 1] for s in starts]).astype(np.int32)
        yield mx.array(windows[:, :-1]), mx.array(windows[:, 1:])


def learning_rate_at(step: int, peak: float, warmup: int, cooldown_start: int | None,
                     cooldown_steps: int | None) -> float:
    """Warmup-stable-decay schedule: linear warmup, constant, linear decay to 10%."""
    if step <= warmup:
        return peak * (0.01 + 0.99 * step / warmup)
    if cooldown_start is None or step <= cooldown_start:
        return peak
    progress = min(1.0, (step - cooldown_start) / max(cooldown_steps, 1))
    return peak * (1.0 - 0.9 * progress)


class Schedule:
    """The warmup-stable-decay schedule of a run, with its cooldown placement.

    The cooldown (linear decay to 10% of peak) is either fixed up front
    (``cooldown_start``/``cooldown_steps``, replaying a recorded run) or placed
    at run time: over the last 20% of ``steps`` or, if 80% of ``max_minutes``
    elapses first, from then on, sized from the measured step rate to end at
    ``max_minutes``. ``last_step`` is the step the run ends at; a run whose
    cooldown is not fixed also stops at 110% of ``max_minutes``.
    """

    def __init__(self, *, steps: int, lr: float, warmup: int, max_minutes: float,
                 cooldown_start: int | None, cooldown_steps: int | None):
        self.steps, self.lr, self.warmup, self.max_minutes = steps, lr, warmup, max_minutes
        self.cooldown_start, self.cooldown_steps = cooldown_start, cooldown_steps
        self.fixed = cooldown_start is not None
        self.last_step = min(steps, cooldown_start + cooldown_steps) if self.fixed else steps
        self.cooldown_reason = "fixed" if self.fixed else None

    @classmethod
    def of(cls, settings: dict) -> Schedule:
        """The schedule a stage's settings describe."""
        return cls(steps=settings["steps"], lr=settings["lr"], warmup=settings["warmup"],
                   max_minutes=settings["max_minutes"],
                   cooldown_start=settings["cooldown_start"],
                   cooldown_steps=settings["cooldown_steps"])

    def learning_rate(self, step: int, elapsed_min: float) -> float:
        """Learning rate of ``step``, placing the cooldown first if it is due."""
        if self.cooldown_start is None:
            if step > 0.8 * self.steps:
                self.cooldown_start, self.cooldown_steps = step - 1, self.steps - (step - 1)
                self.cooldown_reason = "last 20% of steps"
            elif elapsed_min >= 0.8 * self.max_minutes:
                steps_per_min = (step - 1) / elapsed_min
                self.cooldown_start = step - 1
                self.cooldown_steps = max(1, int(steps_per_min
                                                 * (self.max_minutes - elapsed_min)))
                self.last_step = min(self.steps, self.cooldown_start + self.cooldown_steps)
                self.cooldown_reason = f"80% of {self.max_minutes} min elapsed"
            if self.cooldown_start is not None:
                print(f"cooldown from step {self.cooldown_start} for {self.cooldown_steps} "
                      f"steps ({self.cooldown_reason})", flush=True)
        return learning_rate_at(step, self.lr, self.warmup, self.cooldown_start,
                                self.cooldown_steps)

    def out_of_time(self, elapsed_min: float) -> bool:
        """Whether the run stops now: past 110% of its budget with no fixed cooldown."""
        return not self.fixed and elapsed_min > 1.1 * self.max_minutes


class WallClockSchedule:
    """A run sized by the wall clock (``tools/train_mtp.py``): linear warmup over
    ``warmup`` steps, then a linear decay with the elapsed time, floored at 5% of
    peak; the run stops when ``max_minutes`` have elapsed (or at ``steps``)."""

    def __init__(self, *, steps: int, lr: float, max_minutes: float, warmup: int = 20):
        self.steps = self.last_step = steps
        self.lr, self.warmup, self.max_minutes = lr, warmup, max_minutes
        self.fixed = False
        self.cooldown_start = self.cooldown_steps = None
        self.cooldown_reason = "linear in the wall clock"

    def learning_rate(self, step: int, elapsed_min: float) -> float:
        """Learning rate of ``step`` (1-based) at ``elapsed_min``."""
        decay = max(0.05, 1 - elapsed_min / self.max_minutes)
        return self.lr * min(1.0, step / self.warmup) * decay

    def out_of_time(self, elapsed_min: float) -> bool:
        """Whether the budget is spent."""
        return elapsed_min >= self.max_minutes


class LoopResult(NamedTuple):
    """What :func:`train_loop` returns."""

    stats: dict
    timing: dict
    losses: list[tuple]


def train_loop(step_fn, optimizer, batches, *, schedule, batch: int, seq_len: int, checkpoint,
               checkpoint_every: int, log_every: int,
               loss_names: tuple[str, ...]) -> LoopResult:
    """The training loop of every stage.

    Each step sets ``optimizer``'s learning rate from ``schedule`` (a
    :class:`Schedule` or :class:`WallClockSchedule`), takes the next item of
    ``batches`` and calls ``step_fn(*batch) -> (values, grad_norm)``: ``values``
    is the step's loss (a float) or its loss terms (a tuple of floats named by
    ``loss_names``, the first being the total); ``grad_norm`` may be None (no
    clipping). Logs the window means every ``log_every`` steps, checkpoints every
    ``checkpoint_every`` (``checkpoint(step, last logged loss)``) and stops at
    ``schedule.last_step`` or when ``schedule.out_of_time``.

    Returns:
        The run's statistics (steps, schedule and cooldown as used), its timing and
        the logged ``(step, *window means)``.
    """
    start = time.time()
    recent, losses = [], []
    step = 0
    stopped_early = False
    while step < schedule.last_step:
        step += 1
        elapsed_min = (time.time() - start) / 60
        optimizer.learning_rate = schedule.learning_rate(step, elapsed_min)
        values, grad_norm = step_fn(*next(batches))
        recent.append(values)
        if step % log_every == 0 or step == 1:
            elapsed = time.time() - start
            mean = [float(v) for v in np.atleast_1d(np.mean(recent, axis=0))]
            losses.append((step, *mean))
            terms = " ".join(f"{name} {value:.4f}" for name, value in zip(loss_names, mean))
            gnorm = "" if grad_norm is None else f" gnorm {grad_norm.item():.2f}"
            print(f"step {step:5d}/{schedule.last_step} {terms}{gnorm} "
                  f"lr {optimizer.learning_rate.item():.2e} "
                  f"{step * batch * seq_len / elapsed:7.0f} tok/s {elapsed / 60:6.1f} min",
                  flush=True)
            recent = []
        if step % checkpoint_every == 0:
            checkpoint(step, losses[-1][1] if losses else float("nan"))
        if schedule.out_of_time((time.time() - start) / 60):
            print(f"hard time cap reached at step {step}", flush=True)
            stopped_early = True
            break
    wall = time.time() - start
    stats = {
        "steps": step,
        "steps_max": schedule.steps,
        "stopped_early": stopped_early,
        "batch": batch,
        "seq_len": seq_len,
        "tokens_seen": step * batch * seq_len,
        "peak_lr": schedule.lr,
        "warmup_steps": schedule.warmup,
        "cooldown_start": schedule.cooldown_start,
        "cooldown_steps": schedule.cooldown_steps,
        "cooldown_reason": schedule.cooldown_reason,
    }
    timing = {"wall_time_s": round(wall, 1),
              "tokens_per_s": round(step * batch * seq_len / wall, 1)}
    return LoopResult(stats, timing, losses)


def compiled_step(module: nn.Module, optimizer, loss_fn):
    """One optimizer step of ``loss_fn`` on ``module``: gradient, clip to norm 1, update.

    ``loss_fn(module, *inputs)`` returns the loss or a tuple whose first item is the
    loss (the rest are logged terms). The gradient and update are compiled; the
    returned ``step(*inputs)`` evaluates them and gives ``(loss or loss terms as
    floats, grad_norm)``, what :func:`train_loop` takes from its ``step_fn``.
    """
    loss_and_grad = nn.value_and_grad(module, loss_fn)
    state = [module.state, optimizer.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def update(*inputs):
        values, grads = loss_and_grad(module, *inputs)
        grads, grad_norm = optim.clip_grad_norm(grads, max_norm=1.0)
        optimizer.update(module, grads)
        return (*values, grad_norm) if isinstance(values, tuple) else (values, grad_norm)

    def step(*inputs):
        *values, grad_norm = update(*inputs)
        mx.eval(state, *values)
        values = tuple(v.item() for v in values)
        return (values[0] if len(values) == 1 else values), grad_norm

    return step


def loss_curve(losses: list[tuple]) -> list[list]:
    """About 40 of the logged ``(step, *losses)``, losses rounded to 4 decimals."""
    return [[s, *(round(v, 4) for v in values)]
            for s, *values in losses[:: max(1, len(losses) // 40)]]


def summary(run: LoopResult, fields: dict, *, seed: int, finals: tuple[str, ...]) -> dict:
    """A stage's training record: the loop's statistics, ``fields``, the seed, the timing,
    the final losses (means of the last 5 logged windows, named by ``finals``) and the
    loss curve."""
    window = [values for _, *values in run.losses[-5:]]
    means = np.mean(window, axis=0) if window else [None] * len(finals)
    return {
        **run.stats,
        **fields,
        "seed": seed,
        **run.timing,
        **{name: None if v is None else float(v) for name, v in zip(finals, means)},
        "loss_curve": loss_curve(run.losses),
    }
