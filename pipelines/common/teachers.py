"""Published teachers (``train_teacher`` output, ``<out>/teachers/<run>``) loaded to score on
either engine; shared by the jobs that label with a teacher or evaluate one."""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np

from artifacts import storage
from models.config import TeacherConfig
from models.errors import InputError


def teacher_for_engine(uri: str, engine: str) -> TeacherConfig:
    """The published teacher's config, once ``engine`` is known to run it here (InputError
    otherwise): vLLM serves causal-LM teachers only, and needs vLLM installed."""
    from pipelines.common.vllm_engine import check_engine

    cfg = TeacherConfig.from_json(storage.read_file(uri, "teacher.json"))
    if engine == "vllm" and cfg.kind != "causal":
        raise InputError(
            f"{uri} is a {cfg.kind} teacher; the vllm engine serves causal-LM teachers "
            "(their candidates share the history prefix): use --engine hf"
        )
    check_engine(engine)
    return cfg


@contextlib.contextmanager
def load_teacher(uri: str, engine: str = "hf", serving: bool = False):
    """A published teacher (``<out>/teachers/<run>``) ready to score: the teacher of its kind
    in eval mode (``engine`` hf) or a VllmTeacher (vllm, causal teachers only), both with
    ``score(examples, batch_size)``; with ``serving``, vLLM's async engine instead
    (``AsyncVllmTeacher``, awaitable ``score``). Whatever the engine needs is loaded inside the
    context."""
    from models.teacher import build_teacher
    from pipelines.common.vllm_engine import AsyncVllmTeacher, VllmTeacher

    cfg = teacher_for_engine(uri, engine)
    with storage.local_folder(uri) as d:
        cfg = dataclasses.replace(cfg, model_dir=d)
        if engine == "hf":
            yield build_teacher(cfg).eval()
        else:
            yield (AsyncVllmTeacher if serving else VllmTeacher)(d, cfg)


def sampled_ranks(teacher, hist, fb, targets, negatives, titles, batch_size: int) -> np.ndarray:
    """Rank of each user's target among their sampled negatives (0 = first) by teacher score;
    ties count against the target."""
    from models.teacher import examples_for

    ranks = []
    for h, f, t, negs in zip(hist, fb, targets, negatives, strict=True):
        row = [int(t), *[int(n) for n in negs]]
        scores = teacher.score(examples_for(h, f, [len(h)], [row], titles), batch_size)
        ranks.append(int((scores[1:] >= scores[0]).sum()))
    return np.asarray(ranks, dtype=np.int64)
