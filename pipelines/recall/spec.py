"""The recall-task registry and spec: which tasks exist, and what one cell of a context × depth grid asks for.

:data:`TASKS` maps a task name to its family (one file per family in this package). This module imports nothing
from the pipeline stages, so the config can validate task names against it cheaply.
"""
from __future__ import annotations

from dataclasses import dataclass

from pipelines.recall.base import Family, RecallSample, build_sample
from pipelines.recall.common_words import CommonWords
from pipelines.recall.haystack import ESSAY, REPEAT, WORD_LIST
from pipelines.recall.niah import Needles
from pipelines.recall.variable_tracking import VariableTracking

TASKS: dict[str, Family] = {f.name: f for f in (
    Needles("niah_single", REPEAT),
    Needles("niah_single_essay", ESSAY),
    *(Needles(f"niah_multikey_{keys}", ESSAY, keys=keys) for keys in (2, 4)),
    *(VariableTracking(f"variable_tracking_{hops}", REPEAT, hops=hops) for hops in (1, 2, 3, 4)),
    CommonWords("common_words", WORD_LIST),
)}


def check_task(name: str) -> None:
    if name not in TASKS:
        raise ValueError(f"unknown recall task {name!r}; known: {', '.join(TASKS)}")


@dataclass(frozen=True)
class TaskSpec:
    """``samples`` prompts of task ``task``, each ``context`` tokens long (under the evaluated model's tokenizer),
    with the needle after a fraction ``depth`` of the filler; ``seed`` picks the facts."""

    task: str
    context: int
    depth: float = 0.5
    samples: int = 16
    seed: int = 0

    def __post_init__(self):
        check_task(self.task)
        if isinstance(self.context, bool) or not isinstance(self.context, int) or self.context < 1:
            raise ValueError(f"recall task {self.task!r}: context must be a positive number of tokens, "
                             f"got {self.context!r}")
        if isinstance(self.depth, bool) or not isinstance(self.depth, (int, float)) or not 0 <= self.depth <= 1:
            raise ValueError(f"recall task {self.task!r}: depth must be in [0, 1] (the fraction of the filler before "
                             f"the needle), got {self.depth!r}")
        if isinstance(self.samples, bool) or not isinstance(self.samples, int) or self.samples < 1:
            raise ValueError(f"recall task {self.task!r}: samples must be >= 1, got {self.samples!r}")

    def check_fits(self, max_context: int | None) -> None:
        """A clear error when the prompt cannot fit the model (``max_context``: its ``max_position_embeddings``)."""
        if max_context is not None and self.context > max_context:
            raise ValueError(f"recall task {self.task!r}: context {self.context} is longer than the model's context of "
                             f"{max_context} tokens (max_position_embeddings): use context <= {max_context}")


def generate_samples(spec: TaskSpec, tokenizer, *, max_context: int | None = None) -> list[RecallSample]:
    """The ``spec.samples`` samples of ``spec``, deterministic in ``(spec, tokenizer)``; ``max_context`` (the model's
    context length) is checked first."""
    spec.check_fits(max_context)
    family = TASKS[spec.task]
    return [build_sample(family, spec, index, tokenizer) for index in range(spec.samples)]
