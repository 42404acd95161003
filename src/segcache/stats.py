"""GenerationStats: what one generation (one row of a decoder) did and where the time went."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List


@dataclass
class GenerationStats:
    """What one generation did and where the time went.

    Attributes:
        mode: "plain", "draft", "lookup", "mtp", "dflash" or "lookup+dflash".
        prompt_tokens: tokens in the prompt (new tokens only when continuing a runtime).
        prompt_time: seconds until the first generated token (prefill included).
        generation_tokens: tokens emitted (an EOS included).
        generation_time: seconds from the first token to the last.
        rounds: target forwards after the prefill (one per round).
        drafted / accepted: draft tokens proposed / accepted by the target.
        draft_time / verify_time / commit_time: seconds drafting (building the
            draft model's graph and evaluating the drafts the gate reads, or
            n-gram lookup), in the verify forwards and acceptance (for a draft
            model this includes evaluating the drafts not read yet, which run
            in the same graph), and committing branches. With the "replay"
            recurrent strategy part of a commit's work is lazy and lands in
            the next forward.
        drafted_per_round / accepted_per_round: per verify round.
    """

    mode: str = "plain"
    prompt_tokens: int = 0
    prompt_time: float = 0.0
    generation_tokens: int = 0
    generation_time: float = 0.0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_time: float = 0.0
    verify_time: float = 0.0
    commit_time: float = 0.0
    drafted_per_round: List[int] = field(default_factory=list)
    accepted_per_round: List[int] = field(default_factory=list)

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_time if self.prompt_time > 0 else 0.0

    @property
    def generation_tps(self) -> float:
        return self.generation_tokens / self.generation_time if self.generation_time > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        """Mean drafts accepted per round (rounds that drafted nothing count as 0)."""
        return self.accepted / self.rounds if self.rounds else 0.0

    def summary(self) -> str:
        """A few human-readable lines, as `generate(verbose=True)` prints them."""
        lines = [
            f"Prompt: {self.prompt_tokens} tokens, {self.prompt_tps:.3f} tokens-per-sec",
            f"Generation: {self.generation_tokens} tokens, {self.generation_tps:.3f} tokens-per-sec",
        ]
        if self.mode != "plain":
            lines.append(
                f"Speculative ({self.mode}): {self.rounds} rounds, drafted {self.drafted}, "
                f"accepted {self.accepted} ({self.acceptance_rate:.1%}), "
                f"{self.mean_accepted:.2f} accepted per round"
            )
            lines.append(
                f"Time: draft {self.draft_time:.3f}s, verify {self.verify_time:.3f}s, "
                f"commit {self.commit_time:.3f}s"
            )
        return "\n".join(lines)
