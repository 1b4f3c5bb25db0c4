"""Prefect tasks: one per stage, each a thin wrapper around plain functions.

Every stage task takes the store URI, the config that determines its output and the
`ArtifactRef`s of its inputs. It

1. computes the stage key (stage name, code version, config, input keys);
2. returns the committed artifact if the store already has that key;
3. otherwise loads its inputs, calls one plain function, commits one artifact.

Prefect's cache key is the same stage key and the persisted result is the
`ArtifactRef` as JSON, so a rerun with the same config does not even enter the task.
`EXECUTED` counts, per stage, how often step 3 actually ran in this process.
"""

from __future__ import annotations

import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Literal

import pyarrow as pa

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.context import TaskRunContext

from farmflow.annotators import annotate
from farmflow.config import AnnotatorConfig, BestOfNConfig, CheckpointConfig, DataConfig, ModelConfig, RewardConfig, SampleConfig, SFTConfig
from farmflow.data import alpaca, build_synthetic_farm, prompts_of, split_digests, split_rows, synthetic
from farmflow.evaluation import VERSION as EVAL_VERSION
from farmflow.evaluation import evaluate_outputs, leaderboard_markdown, leaderboard_rows, plot_leaderboard, run_of_rows
from farmflow.evaluation.leaderboard import annotator_label, reference_label
from farmflow.evaluation.reward_report import report_rows
from farmflow.generation import sample_texts, scored_candidates_vllm
from farmflow.methods import best_of_n as bon
from farmflow.methods import reward as rm
from farmflow.methods import reward_conditioning as rc
from farmflow.methods import sft
from farmflow.models import (
    SAMPLER_VERSION, build_policy, load_policy, load_pretrained, load_reward, load_tokenizer, reward_from_policy, save, score,
    train_tokenizer,
)
from farmflow.progress import progress
from farmflow.storage import ArtifactRef, canonical_json, open_store, stage_key
from farmflow.storage.schemas import SCHEMAS
from farmflow.tasks.core import EXECUTED, VERSIONS, checkpointer, config_get, log, lookup, stage_task  # noqa: F401 (re-exported)

# ----------------------------------------------------------------------- stages
@stage_task("data", version=f"1+synthetic{synthetic.VERSION}")
def data_task(store_uri: str, config: DataConfig) -> ArtifactRef:
    """All splits of the farm as one ``instructions`` table (synthetic, or AlpacaFarm data from files or the hub)."""
    store, key, hit = lookup("data", store_uri, config)
    if hit:
        return hit
    if config.source == "synthetic":
        table, counts = build_synthetic_farm(config), {}
    else:
        table, counts = alpaca.build_real_farm(config)
        log("data: %s", ", ".join(f"{k} {v:.0f}" for k, v in counts.items()) or "every row used")
    counts |= {f"rows_{split}": float(n) for split, n in Counter(table.column("split").to_pylist()).items()}
    return store.put_table("data", key, table, "instructions", config=config, metrics=counts, parts=split_digests(table))


@stage_task("base_model", version="1", reads=lambda c: {"data": () if config_get(c, "pretrained") else None})
def base_model_task(store_uri: str, config: ModelConfig, data: ArtifactRef) -> ArtifactRef:
    """A pretrained causal LM (model.pretrained), or a tokenizer trained on the farm's text and a randomly initialized tiny Llama."""
    store, key, hit = lookup("base_model", store_uri, config, data=data)
    if hit:
        return hit
    if config.pretrained:
        model, tokenizer = load_pretrained(config)
    else:
        rows = store.read_table(data).to_pylist()
        texts = prompts_of(rows) + [r["output"] for r in rows if r["output"]]
        tokenizer = train_tokenizer(texts, config.vocab_size)
        model = build_policy(config, tokenizer)
    with store.put_model("base_model", key, "policy", config=config, inputs={"data": data}) as (folder, metrics):
        save(model, tokenizer, folder)
        metrics["parameters"] = float(sum(p.numel() for p in model.parameters()))
    return store.get("base_model", key)


@stage_task("sft", version=sft.VERSION, reads=lambda c: {"data": ("sft",)})
def sft_task(store_uri: str, config: SFTConfig, data: ArtifactRef, base: ArtifactRef, checkpoints: CheckpointConfig | None = None) -> ArtifactRef:
    """Supervised fine-tuning of the base model on the SFT split's demonstrations (resumable)."""
    store, key, hit = lookup("sft", store_uri, config, data=data, base=base)
    if hit:
        return hit
    rows = split_rows(store.read_table(data), "sft")
    model, tokenizer = load_policy(store.model_dir(base))
    start = time.perf_counter()
    ckpt = checkpointer(store, "sft", key, checkpoints)
    metrics = sft.train_sft(model, tokenizer, prompts_of(rows), [r["output"] for r in rows], config, model.config.max_position_embeddings, ckpt)
    metrics["seconds"] = time.perf_counter() - start
    log("sft: %d steps, loss %.3f -> %.3f, %.0f tokens/s", metrics["steps"], metrics["train_loss_first"],
         metrics["train_loss_last"], metrics["train_tokens"] / metrics["seconds"])
    with store.put_model("sft", key, "policy", config=config, inputs={"data": data, "base": base}) as (folder, m):
        save(model, tokenizer, folder)
        m.update(metrics)
    ckpt.clear()
    return store.get("sft", key)


@stage_task("sample_pairs", version=f"1+sampler{SAMPLER_VERSION}", reads=lambda c: {"data": ("pref", "val")})
def sample_pairs_task(store_uri: str, config: SampleConfig, data: ArtifactRef, policy: ArtifactRef) -> ArtifactRef:
    """Two samples of the policy per PREF and val instruction (paper: temperature 1.0)."""
    store, key, hit = lookup("sample_pairs", store_uri, config, data=data, policy=policy)
    if hit:
        return hit
    table = store.read_table(data)
    rows = split_rows(table, "pref") + split_rows(table, "val")
    with progress("sample_pairs", len(rows), unit="prompt") as bar:
        outs = sample_texts(config.backend, store.model_dir(policy), prompts_of(rows), n=2, temperature=config.temperature,
                            top_p=config.top_p, max_new_tokens=config.max_new_tokens, batch_size=config.batch_size, seed=config.seed,
                            field="pairs.backend", progress=bar.update)
    pairs = [{**{k: r[k] for k in ("id", "split", "instruction", "input", "task")}, "output_1": o[0], "output_2": o[1]} for r, o in zip(rows, outs)]
    identical = sum(p["output_1"] == p["output_2"] for p in pairs)
    return store.put_table("sample_pairs", key, pa.Table.from_pylist(pairs, schema=SCHEMAS["pairs"]), "pairs", config=config,
                           inputs={"data": data, "policy": policy}, metrics={"identical_pairs": float(identical)})


@stage_task("annotate", version="1")
def annotate_task(store_uri: str, config: AnnotatorConfig, pairs: ArtifactRef) -> ArtifactRef:
    """Simulated pairwise preferences for every pair (p_sim^ann with the default config).

    API annotators use the store's row cache (nothing is paid twice); their run totals
    (requests, tokens, cost_usd, cached, judged) are in the artifact's metrics.
    """
    store, key, hit = lookup("annotate", store_uri, config, pairs=pairs)
    if hit:
        return hit
    rows = store.read_table(pairs).to_pylist()
    with progress("annotate", len(rows), unit="pair") as bar:
        table, run_totals = annotate(rows, config, store_uri, progress=bar.update)
    prefs = table.column("preference").to_pylist()
    metrics = run_totals | {"output_2_preferred": float(sum(p > 1.5 for p in prefs) / max(1, len(prefs)))}
    if config.kind == "api":
        log("annotate: %d pairs: %d judged now, %d from the cache, %d label-noised; %d requests, $%.4f",
            len(prefs), run_totals["judged"], run_totals["cached"], run_totals["noised"], run_totals["requests"], run_totals["cost_usd"])
    return store.put_table("annotate", key, table, "preferences", config=config, inputs={"pairs": pairs}, metrics=metrics)


@stage_task("train_reward", version=rm.VERSION)
def train_reward_task(store_uri: str, config: RewardConfig, preferences: ArtifactRef, sft: ArtifactRef) -> ArtifactRef:
    """Bradley–Terry reward model from the SFT model, trained on PREF, measured on val."""
    store, key, hit = lookup("train_reward", store_uri, config, preferences=preferences, sft=sft)
    if hit:
        return hit
    table = store.read_table(preferences)
    train, held = split_rows(table, "pref"), split_rows(table, "val")
    model = reward_from_policy(store.model_dir(sft), seed=config.seed)
    tokenizer = load_tokenizer(store.model_dir(sft))
    col = lambda rows, k: [r[k] for r in rows]  # noqa: E731
    start = time.perf_counter()
    metrics = rm.train_reward(model, tokenizer, prompts_of(train), col(train, "output_1"), col(train, "output_2"),
                              col(train, "preference"), config, model.config.max_position_embeddings)
    metrics["seconds"] = time.perf_counter() - start
    if held:
        r1 = score(model, tokenizer, prompts_of(held), col(held, "output_1")).tolist()
        r2 = score(model, tokenizer, prompts_of(held), col(held, "output_2")).tolist()
        metrics.update(heldout_accuracies(held, r1, r2))
        log("train_reward: held-out accuracy %.3f (un-noised labels %.3f, gold %.3f) on %d val pairs",
             metrics["heldout_accuracy"], metrics.get("heldout_accuracy_unnoised", float("nan")),
             metrics.get("heldout_gold_accuracy", float("nan")), len(held))
    with store.put_model("train_reward", key, "reward", config=config, inputs={"preferences": preferences, "sft": sft}) as (folder, m):
        save(model, tokenizer, folder)
        m.update(metrics)
    return store.get("train_reward", key)


def heldout_accuracies(rows: list[dict], r1: list[float], r2: list[float]) -> dict[str, float]:
    """Reward-model accuracy on annotated pairs it was not trained on.

    * heldout_accuracy: against the stored labels (p_sim^ann: a quarter are coin flips);
    * heldout_accuracy_unnoised: on the pairs an annotator actually judged (what the
      p_sim^eval pool would say; the coin flips are unpredictable by construction);
    * heldout_gold_accuracy: against the gold reward, on pairs whose gold differs.
    """
    names = {"labels": "heldout_accuracy", "unnoised": "heldout_accuracy_unnoised", "gold": "heldout_gold_accuracy"}
    return {names[r["target"]]: r["accuracy"] for r in report_rows(rows, {"reward": (r1, r2)}, by_family=False)
            if r["target"] in names and (r["pairs"] or r["target"] == "labels")}


def _outputs_table(rows: list[dict], outputs: list[str], generator: str, scores: list[float] | None = None) -> pa.Table:
    return pa.Table.from_pylist(
        [{**{k: r[k] for k in ("id", "instruction", "input", "task")}, "output": o, "generator": generator,
          "score": (scores[i] if scores else None)} for i, (r, o) in enumerate(zip(rows, outputs))],
        schema=SCHEMAS["outputs"],
    )


def generate_config(config: dict) -> dict:
    """generate's config with its sampling section typed (it arrives as JSON on a GPU worker)."""
    return {**config, "sample": SampleConfig.model_validate(config["sample"])}


@stage_task("generate", version=f"1+sampler{SAMPLER_VERSION}", typed=generate_config, reads=lambda c: {"data": ("eval",)})
def generate_task(store_uri: str, config: dict, data: ArtifactRef, policy: ArtifactRef) -> ArtifactRef:
    """One sample per evaluation instruction.

    config: {"sample": SampleConfig, "generator": name, "control": ""}; a non-empty
    `control` is a control token appended to every prompt (reward conditioning's good token).
    `sample.backend` picks the sampler (`farmflow.generation`); it is not part of the key.
    """
    config = generate_config(config)  # typed even when it arrives as JSON, so the backend never enters the key
    cfg = config["sample"]
    store, key, hit = lookup("generate", store_uri, config, data=data, policy=policy)
    if hit:
        return hit
    rows = split_rows(store.read_table(data), "eval")
    with progress(f"generate {config['generator']}", len(rows), unit="prompt") as bar:
        outs = sample_texts(cfg.backend, store.model_dir(policy), rc.conditioned_prompts(prompts_of(rows), config.get("control", "")),
                            n=1, temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
                            batch_size=cfg.batch_size, seed=cfg.seed, field="generation.backend", progress=bar.update)
    return store.put_table("generate", key, _outputs_table(rows, [o[0] for o in outs], config["generator"]), "outputs",
                           config=config, inputs={"data": data, "policy": policy})


@stage_task("best_of_n", version=f"{bon.VERSION}+sampler{SAMPLER_VERSION}", reads=lambda c: {"data": (config_get(c, "split", "eval"),)})
def best_of_n_task(
    store_uri: str, config: dict, data: ArtifactRef, policy: ArtifactRef, reward: ArtifactRef, backend: Literal["hf", "vllm"] = "hf",
    batch_size: int = 64,
) -> ArtifactRef:
    """Best of n policy samples per instruction of a split, chosen by the reward model.

    config: {"best_of_n": BestOfNConfig, "max_new_tokens": int, "split": "eval", "max_prompts": None}. The eval split gives best-of-n's evaluated outputs; the unlabeled
    split gives expert iteration's selections (`max_prompts` keeps the first ones only).
    `backend` (generation.backend) picks the sampler and `batch_size` (generation.batch_size) is
    the number of sequences per forward pass: options like `checkpoints`, not part of the key
    (each candidate has its own random stream, so the batch size does not change the samples).
    """
    store, key, hit = lookup("best_of_n", store_uri, config, data=data, policy=policy, reward=reward)
    if hit:
        return hit
    cfg = BestOfNConfig.model_validate(config["best_of_n"])
    rows = split_rows(store.read_table(data), config.get("split", "eval"))[: config.get("max_prompts")]
    args = dict(n=cfg.n, temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=config["max_new_tokens"],
                batch_size=batch_size, seed=cfg.seed)
    if backend == "vllm":
        candidates, rewards = scored_candidates_vllm(store.model_dir(policy), store.model_dir(reward), prompts_of(rows), **args)
    else:
        model, tokenizer = load_policy(store.model_dir(policy))
        reward_model, reward_tokenizer = load_reward(store.model_dir(reward))
        candidates, rewards = bon.scored_candidates(model, tokenizer, reward_model, reward_tokenizer, prompts_of(rows), **args)
    every = [{"id": r["id"], "sample": j, "output": o} for r, c in zip(rows, candidates) for j, o in enumerate(c)]
    return _scored_outputs(store, "best_of_n", key, rows, every, cfg.n, cfg.n, config, {"data": data, "policy": policy, "reward": reward}, rewards)


CANDIDATES = "candidates.parquet"
"""Every candidate best-of-n drew and its reward (schema ``candidates``), beside the chosen outputs."""


def _candidates(store, best_of_n: ArtifactRef, stage: str) -> tuple[list[dict], list[dict], int]:
    """A best-of-n artifact's output rows, its candidates (checked: the same count for every row, in row order) and that count."""
    rows = store.read_table(best_of_n).to_pylist()
    every = store.read_table(best_of_n, CANDIDATES, "candidates").to_pylist()
    big = len(every) // max(1, len(rows))
    if not rows or len(every) != big * len(rows) or any(c["id"] != r["id"] for i, r in enumerate(rows) for c in every[i * big:(i + 1) * big]):
        raise ValueError(f"{stage}: {CANDIDATES} of {best_of_n.stage} {best_of_n.key} does not hold the same number of candidates per output row")
    return rows, every, big


def _scored_outputs(store, stage: str, key: str, rows: list[dict], every: list[dict], big: int, n: int, config: dict,
                    inputs: dict, rewards: list[float] | None = None) -> ArtifactRef:
    """Best-of-n among each row's first n candidates; with `rewards` (new scores), the candidates are kept with them."""
    rewards = [c["reward"] for c in every] if rewards is None else rewards
    outs, scores = bon.pick_best([[c["output"] for c in every[i * big:(i + 1) * big]] for i in range(len(rows))], rewards, n=n)
    extra = {CANDIDATES: (pa.Table.from_pylist([c | {"reward": r} for c, r in zip(every, rewards)], schema=SCHEMAS["candidates"]),
                          "candidates")} if n == big else None
    return store.put_table(stage, key, _outputs_table(rows, outs, f"best_of_{n}", scores), "outputs", config=config, inputs=inputs,
                           metrics={"mean_reward": sum(scores) / max(1, len(scores))}, extra_tables=extra)


@stage_task("best_of_n_prefix", version="1")
def best_of_n_prefix_task(store_uri: str, config: dict, best_of_n: ArtifactRef, reward: ArtifactRef) -> ArtifactRef:
    """Best-of-k from a best-of-N artifact's candidates, k ≤ N: no sampling, no scoring.

    Candidates nest across n (each has its own random stream), so the first k of best-of-N's
    candidates are exactly best-of-k's, and the reward model's favourite among them is
    best-of-k's output (`farmflow.methods.best_of_n.pick_best`). The over-optimization flow
    samples the largest n once and derives the others. config: {"n": k}. `reward` must be
    the reward model that scored the candidates (it is recorded, so the proxy reward of
    these outputs is reused rather than recomputed).
    """
    store, key, hit = lookup("best_of_n_prefix", store_uri, config, best_of_n=best_of_n, reward=reward)
    if hit:
        return hit
    scored_by = store.record(best_of_n)["inputs"].get("reward")
    if scored_by != reward.key:
        raise ValueError(f"best_of_n_prefix: {best_of_n.stage} {best_of_n.key} was scored by reward model {scored_by}, not {reward.key}")
    rows, every, big = _candidates(store, best_of_n, "best_of_n_prefix")
    if not 1 <= config["n"] <= big:
        raise ValueError(f"best_of_n_prefix: n={config['n']} must be between 1 and the artifact's n={big}")
    return _scored_outputs(store, "best_of_n_prefix", key, rows, every, big, config["n"], config, {"best_of_n": best_of_n, "reward": reward})


@stage_task("best_of_n_rescore", version="1")
def best_of_n_rescore_task(store_uri: str, config: dict, best_of_n: ArtifactRef, reward: ArtifactRef, batch_size: int = 64) -> ArtifactRef:
    """The same candidates as a best-of-n artifact, scored and chosen by another reward model: no sampling.

    The over-optimization flow samples once for all labellers (the candidates depend only on
    the SFT model and the sampling settings). Keeps the candidates with the new rewards, so
    `best_of_n_prefix` works on it. config: {}. `batch_size` is an option (memory only).
    """
    store, key, hit = lookup("best_of_n_rescore", store_uri, config, best_of_n=best_of_n, reward=reward)
    if hit:
        return hit
    rows, every, big = _candidates(store, best_of_n, "best_of_n_rescore")
    model, tokenizer = load_reward(store.model_dir(reward))
    prompts = prompts_of(rows)
    with progress("best_of_n_rescore: score", len(every), unit="sample") as bar:
        rewards = score(model, tokenizer, [prompts[i // big] for i in range(len(every))], [c["output"] for c in every],
                        batch_size=batch_size, progress=bar.update).tolist()
    return _scored_outputs(store, "best_of_n_rescore", key, rows, every, big, big, config, {"best_of_n": best_of_n, "reward": reward}, rewards)


@stage_task("evaluate", version=EVAL_VERSION, reads=lambda c: {"data": ("eval",)})
def evaluate_task(store_uri: str, config: AnnotatorConfig, outputs: ArtifactRef, data: ArtifactRef) -> ArtifactRef:
    """Win rate of the outputs against the reference outputs (p_sim^eval)."""
    store, key, hit = lookup("evaluate", store_uri, config, outputs=outputs, data=data)
    if hit:
        return hit
    table, stats = evaluate_outputs(store.read_table(outputs).to_pylist(), split_rows(store.read_table(data), "eval"), config, store_uri)
    log("evaluate: win rate %.1f ± %.1f, mean gold %.3f", stats["win_rate"], stats["standard_error"], stats["mean_gold"])
    return store.put_table("evaluate", key, table, "evaluation", config=config, inputs={"outputs": outputs, "data": data}, metrics=stats)


@task(name="leaderboard", cache_policy=NO_CACHE, persist_result=False)
def leaderboard_task(store_uri: str, evaluations: dict[str, ArtifactRef], title: str = "Leaderboard") -> ArtifactRef:
    """One row per method from the evaluations (`evaluation.leaderboard_rows`); always rebuilt (it is cheap).

    The LC win rate's instruction difficulty is pooled over the board's evaluations plus
    every other evaluation in the store with the same annotator config and the same
    evaluation split (its content digest; their keys enter the leaderboard's key). The artifact holds the Parquet table plus
    ``leaderboard.md`` and ``leaderboard.png``; inside a flow the table is also published
    as Prefect markdown and table artifacts.
    """
    store = open_store(store_uri)
    committed = store.records()
    records = {r["ref"]["key"]: r for r in committed if r["ref"]["stage"] == "evaluate"}
    data_refs = {r["ref"]["key"]: ArtifactRef.model_validate(r["ref"]) for r in committed if r["ref"]["stage"] == "data"}

    def group(record: dict) -> str:  # same judge, same references (the eval split's content): difficulties are comparable
        data_key = record["inputs"].get("data")
        data = data_refs.get(data_key)
        return canonical_json([record["config"], data.parts.get("eval", data_key) if data else data_key])

    entries = []
    for method, ref in evaluations.items():
        record = records.get(ref.key) or store.record(ref)
        data_key = record["inputs"].get("data") or "?"
        data = store.get("data", data_key)  # its config names the evaluation file of the real farm
        entries.append({"method": method, "metrics": ref.metrics, "rows": store.read_table(ref).to_pylist(), "group": group(record),
                        "annotator": annotator_label(record["config"]), "reference": reference_label(data_key, data and store.record(data)["config"]),
                        "evaluation_key": ref.key})
    groups = {e["group"] for e in entries}
    board_keys = {ref.key for ref in evaluations.values()}
    peers = [r for k, r in records.items() if k not in board_keys and group(r) in groups]
    peer_runs: dict[str, list[dict]] = {}
    for r in peers:
        peer_runs.setdefault(group(r), []).append(run_of_rows(store.read_table(ArtifactRef.model_validate(r["ref"])).to_pylist()))
    rows = leaderboard_rows(entries, peer_runs)
    key = stage_key("leaderboard", "4", {"title": title, "peers": sorted(r["ref"]["key"] for r in peers)}, evaluations)
    markdown = leaderboard_markdown(rows, title)
    ref = store.get("leaderboard", key)
    if ref is None:
        with tempfile.TemporaryDirectory() as tmp:
            plot_leaderboard(rows, f"{tmp}/leaderboard.png", title)
            png = Path(f"{tmp}/leaderboard.png").read_bytes()
        ref = store.put_table(
            "leaderboard", key, pa.Table.from_pylist(rows, schema=SCHEMAS["leaderboard"]), "leaderboard", inputs=evaluations,
            metrics={"difficulty_peer_runs": float(len(peers))},
            extra_files={"leaderboard.md": markdown.encode(), "leaderboard.png": png},
        )
    if TaskRunContext.get() is not None:  # not when called as task.fn(...) outside a flow
        create_markdown_artifact(markdown + f"\nParquet, Markdown and plot: `{ref.uri}`\n", key="leaderboard", description=title)
        cols = ("method", "win_rate", "standard_error", "discrete_win_rate", "lc_win_rate", "mean_gold", "gold_standard_error", "avg_length", "n")
        create_table_artifact([{k: (None if r[k] != r[k] else r[k]) for k in cols} for r in rows],  # NaN is not JSON
                              key="leaderboard-table", description=title)
    return ref
