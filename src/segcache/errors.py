"""Typed errors. Each says what was asked, what the state is, and what to do."""


class SegcacheError(Exception):
    """Base class of every error segcache raises on purpose."""


class BranchError(SegcacheError):
    """A fork/commit/rollback that cannot be carried out; nothing was changed."""


class UnsupportedModelError(SegcacheError):
    """The model uses a layer or cache type that segcache cannot roll back."""


class UnsupportedOperationError(SegcacheError):
    """An mlx-lm cache operation segcache's layers cannot carry out exactly
    (quantizing KV in place, batching); nothing was changed."""


class InvariantError(SegcacheError, AssertionError):
    """`check()` found the runtime or the store inconsistent (a bug: please report)."""


class StoreError(SegcacheError):
    """A prefix-store operation failed; the store is unchanged."""


class StoreWarning(RuntimeWarning):
    """The prefix store failed; the operation went on as a miss (or without the store)."""


class StoreFormatError(StoreError):
    """The store on disk was written by another format version of segcache."""


class ModelError(SegcacheError):
    """A model directory could not be loaded or does not fit the request."""


class RowError(SegcacheError, RuntimeError):
    """One row's own rule (its acceptor, sampler or logits processors) failed while a
    decoder step was built; the decoder is as before the step. `row_id` names the row:
    drop it and step the others again."""

    def __init__(self, row_id, cause: BaseException):
        super().__init__(f"row {row_id!r}: {type(cause).__name__}: {cause}")
        self.row_id = row_id


class ParamError(SegcacheError, ValueError):
    """A sampling or output control has a value that cannot be honoured.

    Attributes:
        param: the request field at fault, dotted (e.g. "top_k",
            "response_format.json_schema.schema"): the server answers 400 naming it.
    """

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class GrammarError(ParamError):
    """A `response_format` (a JSON schema) that cannot be compiled into a grammar."""


class DistributedError(SegcacheError):
    """The ranks of a distributed group could not carry out a step together."""


class RankFailedError(DistributedError):
    """A rank failed a step (its own error, or another rank's): every rank raises it, and
    every rank's state is as before the step."""


class RankDivergedError(DistributedError):
    """The ranks disagree about what they hold or are about to run (a bug, or ranks started
    with different models, prompts or settings): the step was undone on every rank."""


class RankLostError(DistributedError):
    """A rank stopped answering (it died, or its connection was lost): the group cannot go on.
    Stop every rank and start them again; each resumes from its own prefix store."""
