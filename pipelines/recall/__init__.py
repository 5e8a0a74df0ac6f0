"""RULER-style long-range recall tasks, generated offline with the evaluated model's tokenizer and fixed seeds.

One file per task family — ``niah`` (single needle; multi-key: 2 or 4 needles, one asked, the others distractors), ``variable_tracking``
(1–4 hops), ``common_words`` (aggregation) — over the filler of ``haystack``; ``base`` builds a prompt of the
requested length with the needle at the requested depth; ``spec`` holds the registry :data:`TASKS` and
:class:`TaskSpec`; ``scoring`` scores a sample (exact match, gold log-probability and rank); ``calibration`` measures
the dense model's accuracy per task × context × depth and is imported on its own (``pipelines.recall.calibration``),
as it reads the pipeline's config and identity; nothing else here imports a pipeline module.

The facts depend on position: the needle sits at the requested depth of the filler and the question names its key,
never its value, so for depths below ~0.9 a policy that keeps only recent tokens (plus sinks) cannot answer.
"""
from pipelines.recall.base import RecallSample
from pipelines.recall.scoring import gold_logprob_and_rank, score_text
from pipelines.recall.spec import TASKS, TaskSpec, check_task, generate_samples

__all__ = ["RecallSample", "TASKS", "TaskSpec", "check_task", "generate_samples", "gold_logprob_and_rank", "score_text"]
