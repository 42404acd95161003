"""Prefixes computed once: a prompt that shares a prefix with a prompt still being prefilled
waits for that prefix's checkpoint instead of computing the same tokens, bounded by what
computing them itself would take.

    leader   begin ─ chunk ─ chunk ─ ... ─ stop at S: snapshot, published at once ─ chunk ─ ... end
    waiter          arrives: shares S tokens with the leader, the store restores R < S of them
                    asks the leader to stop at S ─ waits (None per step) ─ begin: resumes S, computes the rest
                    gives up when the leader is gone, or once it waited (S - R) x the pace of prefill

S is the longest common prefix of the two prompts. The leader adds a stop there (its plan and
its `PrefillBatch` row, `Prefill.share`, `PrefillBatch.stop_at`) and publishes the prefix when
its forward reaches it, rather than at its end; the waiter then resumes from the store as any
request does, so what it gets is what a later request would get (greedy answers equal).

The bound: the waiter's own cost is its S - R tokens at the pace prompts are computed now:
the store's learned rate (seconds per computed prompt token, `Layout.learn`), or the pace the
leader moved at while the waiter watched when that is slower (a loaded machine, a large
prefill batch: a prompt computed here would go no faster, and would slow the leader down by
sharing its forwards). R is at least what the leader restored from the store when S reaches
that far (the same first tokens, the same domain), so a waiter with S within MIN_SHARED of it
returns without looking the store up (a fan-out once the prefix is stored: the lookup cost
a probe runtime and a walk of the prefix's pages per request). It waits only for a leader with at most S - R tokens left before S, so
a leader that keeps its pace always arrives within that cost; it gives up once it has waited
that long (a leader that stalls: the time since it last moved counts against it), or when the
leader leaves (finished: the store has S; failed or cancelled: the waiter computes). A waiter
holds no prefill slot while it waits.

On under `segcache serve` with a store and several rows. Off under mlx.launch: the decision
reads the clock, and every rank must take the same one. Everything here runs on the model thread.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Generator

from .. import prefill as store_prefill
from ..errors import InvariantError
from ..runtime import Runtime
from ..store.prompt_index import common_prefix

log = logging.getLogger("segcache.serve")

# Tokens a waiter must save at least. Below this the prefix is a fraction of one prefill
# chunk (256), and the leader's extra stop (a forward boundary, a snapshot, an early
# publish) costs about what computing it again would.
MIN_SHARED = 128


@dataclass
class Lead:
    """A prompt being prefilled that others may wait for: its request id, isolation domain and session."""

    request_id: str
    salt: object
    session: object  # segcache.session.Session, begun

    @property
    def position(self) -> int:
        """Prompt tokens its prefill holds now (a PrefillBatch row's count between its stops)."""
        s = self.session
        return s.fed if s.in_batch else s.plan.pos


class Fanout:
    """The prompts being prefilled, and the waiting of the prompts that share their prefixes.

    Args:
        engine: the `Engine` (its model, store, prefill batch and settings).
        enabled: wait at all (default: with a store, several rows, and one process).

    Attributes:
        waited: waits that ended with the prefix published; gave_up: waits that ended without.
    """

    def __init__(self, engine, enabled: bool | None = None):
        self.engine = engine
        if enabled is None:
            enabled = engine.store is not None and not engine.decoder.one_row and engine.group is None
        self.enabled = enabled
        # Invariant: every lead's session has begun with a store; its request's prefill has not returned.
        self.leads: dict[str, Lead] = {}
        self.waited = self.gave_up = 0

    def lead(self, req, session) -> None:
        """`req`'s prompt is being prefilled by `session` (just begun): later prompts may wait for it."""
        plan = session.plan
        if self.enabled and plan.cache is not None and plan.left:
            self.leads[req.id] = Lead(req.id, req.cache_salt, session)

    def end(self, request_id: str) -> None:
        """Its prefill ended (published, failed or cancelled): nobody waits for it any longer."""
        self.leads.pop(request_id, None)

    def wait(self, req) -> Generator[None, None, None]:
        """Yield None per scheduler step while a prompt being prefilled computes a prefix of
        `req`'s that the store lacks and that `req` would take at least as long to compute
        itself; return at once when there is none."""
        if not self.enabled or not self.leads:
            return
        ids = req.ids[:-1]  # what it may wait for: its last token has a forward of its own (session.py)
        shared, lead = max(((common_prefix(ids, lead.session.plan.ids), lead) for lead in self.leads.values()
                            if lead.salt == req.cache_salt), key=lambda t: t[0], default=(0, None))
        if shared < MIN_SHARED:
            return
        restored = lead.session.plan.resume.restored  # the store holds these: this prompt's first ones too
        if restored <= shared < restored + MIN_SHARED:  # too few left to wait for, known without a lookup
            return
        e = self.engine
        probe = Runtime(e.model, store=e.store, cache_salt=req.cache_salt, gdn_prefill="auto")
        stored, spt = store_prefill.lookahead(probe, ids)
        del probe
        own = shared - stored  # tokens this request would compute itself to get there
        start = lead.position
        if own < MIN_SHARED or shared - start > own or not self._ask(lead, shared):
            return
        tic = time.perf_counter()
        seen, seen_at = start, tic  # the leader's position when last seen to move, and when
        budget, outcome = own * spt, "cancelled"  # closed while it waits: its client left
        try:
            while True:
                yield None
                now = time.perf_counter()
                if shared in lead.session.plan.shared or self.leads.get(lead.request_id) is not lead:
                    outcome = "published" if shared in lead.session.plan.shared else "leader gone"
                    break
                if lead.position != seen:
                    seen, seen_at = lead.position, now
                # its own cost at the pace prompts are computed now: the learned rate, or the leader's
                # pace while it moved when slower (the machine's load slows a prompt computed here alike)
                budget = own * max(spt, (seen_at - tic) / (seen - start) if seen > start else 0.0)
                if now - tic > budget:  # the leader stalled: computing them here is as fast by now
                    outcome = "gave up"
                    break
        finally:
            published = outcome == "published"
            self.waited += published
            self.gave_up += not published
            log.info("%s: waited %.3f s for %s's first %d tokens (%d stored, own cost %.3f s): %s",
                     req.id, time.perf_counter() - tic, lead.request_id, shared, stored, budget, outcome)

    def _ask(self, lead: Lead, position: int) -> bool:
        """Make the lead stop at `position` and publish its prefix there; False if it cannot."""
        s = self.engine.prefill_batch  # past the batch row's end the session feeds on alone (`whole`)
        if lead.session.in_batch and position <= lead.session.batch_end and not s.stop_at(lead.request_id, position):
            return False
        return lead.session.plan.share(position)

    def check(self) -> None:
        """Every lead's prefill is under way with a store (see `__init__`)."""
        for rid, lead in self.leads.items():
            plan = lead.session.plan
            if rid != lead.request_id or plan is None or plan.cache is None:
                raise InvariantError(f"lead {rid!r} is no prefill under way with a store")
            plan.check()
