"""Sampling backends for the generation stages: farmflow's own sampler ("hf") or vLLM.

`generation.backend` (and `pairs.backend`) choose how the generate, sample_pairs and
best_of_n stages draw samples from a policy checkpoint:

* ``hf`` (default): `farmflow.models.sample`, the batched KV-cache sampler on the model
  loaded with transformers.
* ``vllm``: `vllm.LLM(model=<checkpoint folder>)` with one request per sample:
  `SamplingParams(n=1, temperature, top_p, max_tokens, seed)`, seeded like the hf sampler's
  stream for that sample (`farmflow.models.sample_seed`), so here too best-of-n candidates
  nest across n (vLLM's prefix cache prefills a prompt once for its n requests). vLLM is
  optional and not a farmflow dependency (``pip install vllm`` on the GPU worker; it brings
  its own CUDA build of torch).

Both give the same outputs schema: n decoded responses per prompt, up to the first EOS,
special tokens dropped, stripped. The prompt is encoded the same way (``<s>`` + the prompt's
tokens, cut from the left to leave room for max_new_tokens), and vLLM's token ids are
decoded with farmflow's `decode_response`. The samples themselves differ from the hf
backend's for the same seed (other random streams and kernels). The backend is
operational: it is not part of any stage key, so an artifact sampled by one backend is
reused when the other is selected.

A vLLM engine takes tens of seconds to start (weights, CUDA graphs, KV-cache allocation), so
the process keeps the last one (`ENGINES`, one slot) and reuses it while calls ask for the same
checkpoint folder (same weight files), dtype and context; asking for another releases it first.
Best-of-n releases it before loading the reward model, whose GPU memory the engine would hold.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any, Callable, Sequence

from farmflow.config import ConfigError


def require_vllm(field: str) -> Any:
    """The `vllm` module, or one ConfigError naming the config field that asked for it."""
    try:
        import vllm
    except ImportError:
        raise ConfigError(
            f"{field} is 'vllm' but vLLM is not installed in this environment: `pip install vllm` on the machine that "
            f"runs generation (it brings its own CUDA torch), or set {field}=hf"
        ) from None
    return vllm


def texts_from_vllm(request_outputs: Sequence[Any], n: int, decode: Callable[[Sequence[int]], str]) -> list[list[str]]:
    """vLLM's `RequestOutput`s, one per sample in (prompt, sample) order → n response texts per prompt.

    Reads only ``request.outputs[0].token_ids``, so plain objects with that attribute work
    too; each request asked for one completion. Completions are decoded with `decode`
    (farmflow's `decode_response`: up to the first EOS, special tokens dropped, stripped). A
    request without exactly one completion, or a count that is not a multiple of n, is an
    error naming it.
    """
    if len(request_outputs) % n:
        raise ValueError(f"vllm: {len(request_outputs)} requests came back, not a multiple of n={n}")
    texts: list[list[str]] = []
    for k, request in enumerate(request_outputs):
        i, j = divmod(k, n)
        if len(request.outputs) != 1:
            raise ValueError(
                f"vllm: prompt {i} sample {j} came back with {len(request.outputs)} completions, expected 1"
            )
        if j == 0:
            texts.append([])
        texts[-1].append(decode(list(request.outputs[0].token_ids)))
    return texts


class EngineCache:
    """One engine at a time, kept between calls: `get(key, build)` returns the engine built for `key`, building it
    (after releasing the one held) when the key differs."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.engine: Any = None

    def get(self, key: tuple, build: Callable[[], Any]) -> Any:
        if self.engine is None or key != self.key:
            self.release()
            self.engine, self.key = build(), key
        return self.engine

    def release(self) -> None:
        """Drop the engine held (its GPU memory goes back when vLLM's engine process ends)."""
        if self.engine is not None:
            self.engine = self.key = None
            gc.collect()


ENGINES = EngineCache()
"""This process's vLLM engine (`vllm_sample`)."""


def engine_key(engine_class: Any, model_dir: str | Path, dtype: str, max_model_len: int) -> tuple:
    """What makes an engine reusable: its class, the checkpoint folder with its weight files' sizes and modification
    times (a folder rewritten in place is a new engine), the dtype and the context length."""
    folder = Path(model_dir).resolve()
    weights = tuple(
        sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in folder.iterdir() if f.suffix != ".json")
    )
    return (engine_class, str(folder), weights, dtype, max_model_len)


def vllm_sample(
    model_dir: str | Path,
    prompts: Sequence[str],
    *,
    n: int,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    seed: int,
    field: str = "generation.backend",
    dtype: str = "auto",
) -> list[list[str]]:
    """n sampled responses per prompt from the checkpoint folder, through vLLM (``result[prompt][sample]``).

    Sample j of prompt i is its own request, seeded with ``sample_seed(seed, i, j)``: a
    reproducible stream per sample, the same whatever n is (so the engine's own seed plays no
    part and one engine serves every seed). The engine stays in `ENGINES` for the next call.
    """
    vllm = require_vllm(field)
    from transformers import AutoConfig

    from farmflow.models import decode_response, load_tokenizer, prompt_ids, sample_seed

    tokenizer = load_tokenizer(model_dir)
    context = AutoConfig.from_pretrained(str(model_dir)).max_position_embeddings
    if max_new_tokens >= context:
        raise ConfigError(
            f"max_new_tokens ({max_new_tokens}) must be smaller than the model's context ({context} tokens)"
        )
    ids = prompt_ids(tokenizer, prompts, context - max_new_tokens)  # the hf sampler's encoding
    llm = ENGINES.get(
        engine_key(vllm.LLM, model_dir, dtype, context),
        lambda: vllm.LLM(model=str(model_dir), dtype=dtype, seed=0, max_model_len=context),
    )
    requests = [(i, j) for i in range(len(prompts)) for j in range(n)]
    params = [
        vllm.SamplingParams(
            n=1, temperature=temperature, top_p=top_p, max_tokens=max_new_tokens, seed=sample_seed(seed, i, j)
        )
        for i, j in requests
    ]
    outputs = llm.generate([{"prompt_token_ids": ids[i]} for i, _ in requests], params, use_tqdm=False)
    return texts_from_vllm(outputs, n, lambda t: decode_response(tokenizer, t))


def sample_texts(
    backend: str,
    model_dir: str | Path,
    prompts: Sequence[str],
    *,
    n: int,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    batch_size: int,
    seed: int,
    field: str,
    progress: Callable[[int], None] | None = None,
) -> list[list[str]]:
    """n sampled responses per prompt from a policy checkpoint folder with the chosen backend."""
    if backend == "vllm":
        out = vllm_sample(
            model_dir,
            prompts,
            n=n,
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=max_new_tokens,
            seed=seed,
            field=field,
        )
        if progress:
            progress(len(prompts))
        return out
    if backend != "hf":
        raise ConfigError(f"{field}: unknown backend {backend!r}; known: hf, vllm")
    from farmflow.models import load_policy, sample

    model, tokenizer = load_policy(model_dir)
    return sample(
        model,
        tokenizer,
        prompts,
        n=n,
        temperature=temperature,
        top_p=top_p,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        seed=seed,
        progress=progress,
    )


def scored_candidates_vllm(
    model_dir: str | Path,
    reward_dir: str | Path,
    prompts: Sequence[str],
    *,
    n: int,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    batch_size: int,
    seed: int,
    field: str = "generation.backend",
) -> tuple[list[list[str]], list[float]]:
    """Best-of-n's candidates with vLLM sampling: n per prompt, each scored by the reward model (loaded after the
    engine is gone; each distinct candidate once, through the process's feature memo as the hf backend); rewards flat,
    prompt-major, for `farmflow.methods.best_of_n.pick_best`."""
    from farmflow.models import FEATURES, load_reward, score

    candidates = vllm_sample(
        model_dir,
        prompts,
        n=n,
        temperature=temperature,
        top_p=top_p,
        max_new_tokens=max_new_tokens,
        seed=seed,
        field=field,
    )
    ENGINES.release()  # the reward model needs the GPU memory the engine holds
    reward_model, reward_tokenizer = load_reward(reward_dir)
    flat_prompts = [p for p, c in zip(prompts, candidates) for _ in c]
    outputs = [o for c in candidates for o in c]
    rewards = score(reward_model, reward_tokenizer, flat_prompts, outputs, batch_size=batch_size, memo=FEATURES)
    return candidates, rewards.tolist()
