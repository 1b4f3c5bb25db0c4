"""Stages of the shared pipeline: data → base model → SFT → pairs → preferences → reward model; outputs →
evaluation.

Each function does one stage's work and returns what to commit; `farmflow.tasks.stage.stage_task` does the rest
(key, cache hit, commit, log). Their facts (version, inputs, reads, GPU) are in `farmflow.tasks.registry.STAGES`.
"""

from __future__ import annotations

from collections import Counter

import pyarrow as pa

from farmflow.annotators import annotate
from farmflow.config import (
    AnnotatorConfig,
    CheckpointConfig,
    DataConfig,
    ModelConfig,
    RewardConfig,
    SampleConfig,
    SFTConfig,
)
from farmflow.data import alpaca, build_synthetic_farm, prompts_of, split_digests, split_rows, synthetic
from farmflow.evaluation import evaluate_outputs
from farmflow.evaluation.reward_report import report_rows
from farmflow.generation import sample_texts
from farmflow.progress import progress
from farmflow.storage import ArtifactRef, open_store
from farmflow.storage.schemas import SCHEMAS
from farmflow.tasks.registry import SFT_SNAPSHOT_STAGE, STAGES, sft_snapshot_key
from farmflow.tasks.stage import Model, StageRun, Table, stage_task
from farmflow.training_metrics import recorder


@stage_task(STAGES["data"])
def data_task(run: StageRun, config: DataConfig) -> Table:
    """All splits of the farm as one ``instructions`` table (synthetic, or AlpacaFarm data from files or the hub)."""
    if config.source == "synthetic":
        table, counts = build_synthetic_farm(config), {}
    else:
        table, counts = alpaca.build_real_farm(config)
    counts |= {f"rows_{split}": float(n) for split, n in Counter(table.column("split").to_pylist()).items()}
    return Table(table, "instructions", counts, parts=split_digests(table))


@stage_task(STAGES["base_model"])
def base_model_task(run: StageRun, config: ModelConfig, data: ArtifactRef) -> Model:
    """A pretrained causal LM (model.pretrained), or a tokenizer trained on the SFT split's text (instructions and
    demonstrations: what the model learns first; never the evaluation set's) and a random tiny Llama."""
    from farmflow.models import build_policy, load_pretrained, train_tokenizer

    if config.pretrained:
        model, tokenizer = load_pretrained(config)
    else:
        rows = split_rows(run.store.read_table(data), "sft")
        tokenizer = train_tokenizer(prompts_of(rows) + [r["output"] for r in rows], config.vocab_size)
        model = build_policy(config, tokenizer)
    return Model(model, tokenizer, {"parameters": float(sum(p.numel() for p in model.parameters()))})


@stage_task(STAGES["sft"])
def sft_task(
    run: StageRun, config: SFTConfig, data: ArtifactRef, base: ArtifactRef, checkpoints: CheckpointConfig | None = None
) -> Model:
    """Supervised fine-tuning of the base model on the SFT split's demonstrations (resumable); with
    ``config.snapshot_epochs`` also the policy after each of those epochs (`sft_snapshot`)."""
    from farmflow.methods.sft import train_sft
    from farmflow.models import load_policy

    rows = split_rows(run.store.read_table(data), "sft")
    model, tokenizer = load_policy(run.store.model_dir(base))

    def snapshot(epochs: float, step: int, trained) -> None:
        config = {"epochs": epochs, "step": step}
        run.snapshot(SFT_SNAPSHOT_STAGE, sft_snapshot_key(run.key, epochs), trained, tokenizer, config, "sft")

    metrics = train_sft(
        model,
        tokenizer,
        prompts_of(rows),
        [r["output"] for r in rows],
        config,
        model.config.max_position_embeddings,
        run.checkpointer(checkpoints),
        snapshot=snapshot,
    )
    return Model(model, tokenizer, metrics)


def sft_snapshot(store_uri: str, sft: ArtifactRef, epochs: float) -> ArtifactRef:
    """The committed policy of the SFT run `sft` after `epochs` (its config's ``snapshot_epochs``)."""
    ref = open_store(store_uri).get(SFT_SNAPSHOT_STAGE, sft_snapshot_key(sft.key, epochs))
    if ref is None:
        raise LookupError(f"the SFT run {sft.key[:12]} has no snapshot after {epochs:g} epochs (sft.snapshot_epochs)")
    return ref


@stage_task(STAGES["sample_pairs"])
def sample_pairs_task(run: StageRun, config: SampleConfig, data: ArtifactRef, policy: ArtifactRef) -> Table:
    """Two samples of the policy per PREF and val instruction (paper: temperature 1.0)."""
    table = run.store.read_table(data)
    rows = split_rows(table, "pref") + split_rows(table, "val")
    with progress("sample_pairs", len(rows), unit="prompt") as bar:
        outs = sample_texts(
            config.backend,
            run.store.model_dir(policy),
            prompts_of(rows),
            n=2,
            temperature=config.temperature,
            top_p=config.top_p,
            max_new_tokens=config.max_new_tokens,
            batch_size=config.batch_size,
            seed=config.seed,
            field="pairs.backend",
            progress=bar.update,
        )
    pairs = [
        {**{k: r[k] for k in ("id", "split", "instruction", "input", "task")}, "output_1": o[0], "output_2": o[1]}
        for r, o in zip(rows, outs)
    ]
    identical = sum(p["output_1"] == p["output_2"] for p in pairs)
    return Table(pa.Table.from_pylist(pairs, schema=SCHEMAS["pairs"]), "pairs", {"identical_pairs": float(identical)})


@stage_task(STAGES["annotate"])
def annotate_task(run: StageRun, config: AnnotatorConfig, pairs: ArtifactRef) -> Table:
    """Simulated pairwise preferences for every pair (p_sim^ann with the default config).

    API annotators use the store's row cache (nothing is paid twice); their run totals
    (requests, tokens, cost_usd, cached, judged) are in the artifact's metrics.
    """
    rows = run.store.read_table(pairs).to_pylist()
    with progress("annotate", len(rows), unit="pair") as bar:
        table, run_totals = annotate(rows, config, run.store_uri, progress=bar.update)
    prefs = table.column("preference").to_pylist()
    return Table(
        table,
        "preferences",
        run_totals | {"output_2_preferred": float(sum(p > 1.5 for p in prefs) / max(1, len(prefs)))},
    )


@stage_task(STAGES["train_reward"])
def train_reward_task(
    run: StageRun,
    config: RewardConfig,
    preferences: ArtifactRef,
    sft: ArtifactRef,
    checkpoints: CheckpointConfig | None = None,
) -> Model:
    """Bradley–Terry reward model from `sft` (the SFT policy, or `reward.backbone` fine-tuned the same way), trained on
    PREF, measured on val (resumable)."""
    from farmflow.methods.reward import train_reward
    from farmflow.models import FEATURES, for_compute, load_tokenizer, reward_from_policy, score

    table = run.store.read_table(preferences)
    train, held = split_rows(table, "pref"), split_rows(table, "val")
    model = reward_from_policy(run.store.model_dir(sft), seed=config.seed)
    tokenizer = load_tokenizer(run.store.model_dir(sft))
    col = lambda rows, k: [r[k] for r in rows]  # noqa: E731
    # a frozen backbone reads an output as every reward model on it does: read each once in this process
    memo = None if config.train_backbone else FEATURES

    def measure(m, progress=None) -> dict[str, float]:
        # both outputs of the pairs in one call: a model that reads packed reads each prompt once for the two
        outputs = col(held, "output_1") + col(held, "output_2")
        r = score(m, tokenizer, prompts_of(held) * 2, outputs, progress=progress, memo=memo).tolist()
        return heldout_accuracies(held, r[: len(held)], r[len(held) :])

    metrics = train_reward(
        model,
        tokenizer,
        prompts_of(train),
        col(train, "output_1"),
        col(train, "output_2"),
        col(train, "preference"),
        config,
        model.config.max_position_embeddings,
        run.checkpointer(checkpoints),
        measure if held else None,
        memo,
    )
    if held and not config.eval_every:  # otherwise the loop measured the weights it kept and logged each measurement
        with progress("train_reward: val", 2 * len(held), unit="output") as bar:
            # trained, the weights are back in their stored dtype: score them as later stages load them (float32
            # where this CPU would emulate half precision), not at emulated speed
            heldout = measure(for_compute(model), bar)
        metrics.update(heldout)
        recorder("reward").log(int(metrics["steps"]), split="val", **heldout)
    return Model(model, tokenizer, metrics, format="reward")


def heldout_accuracies(rows: list[dict], r1: list[float], r2: list[float]) -> dict[str, float]:
    """Reward-model accuracy on annotated pairs it was not trained on.

    * heldout_accuracy: against the stored labels (p_sim^ann: a quarter are coin flips);
    * heldout_accuracy_unnoised: on the pairs an annotator actually judged (what the
      p_sim^eval pool would say; the coin flips are unpredictable by construction);
    * heldout_gold_accuracy: against the gold reward, on pairs whose gold differs.
    """
    names = {"labels": "heldout_accuracy", "unnoised": "heldout_accuracy_unnoised", "gold": "heldout_gold_accuracy"}
    return {
        names[r["target"]]: r["accuracy"]
        for r in report_rows(rows, {"reward": (r1, r2)}, by_family=False)
        if r["target"] in names and (r["pairs"] or r["target"] == "labels")
    }


def reward_model_summary(metrics: dict[str, float]) -> dict[str, float]:
    """What a flow's summary says of a reward model: its held-out accuracies, and the step kept when it was selected
    on val (`RewardConfig.select`)."""
    return {k: v for k, v in metrics.items() if k.startswith("heldout") or k == "selected_step"}


def outputs_table(rows: list[dict], outputs: list[str], generator: str, scores: list[float] | None = None) -> pa.Table:
    """One output per row (an ``outputs`` table), with its score when one chose it."""
    return pa.Table.from_pylist(
        [
            {
                **{k: r[k] for k in ("id", "instruction", "input", "task")},
                "output": o,
                "generator": generator,
                "score": (scores[i] if scores else None),
            }
            for i, (r, o) in enumerate(zip(rows, outputs))
        ],
        schema=SCHEMAS["outputs"],
    )


@stage_task(STAGES["generate"])
def generate_task(run: StageRun, config: dict, data: ArtifactRef, policy: ArtifactRef) -> Table:
    """One sample per evaluation instruction.

    config: {"sample": SampleConfig, "generator": name, "control": ""}; a non-empty
    `control` is a control token appended to every prompt (reward conditioning's good token).
    `sample.backend` picks the sampler (`farmflow.generation`); it is not part of the key.
    """
    from farmflow.methods.reward_conditioning import conditioned_prompts

    cfg = config["sample"]
    rows = split_rows(run.store.read_table(data), "eval")
    prompts = conditioned_prompts(prompts_of(rows), config.get("control", ""))
    with progress(f"generate {config['generator']}", len(rows), unit="prompt") as bar:
        outs = sample_texts(
            cfg.backend,
            run.store.model_dir(policy),
            prompts,
            n=1,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            max_new_tokens=cfg.max_new_tokens,
            batch_size=cfg.batch_size,
            seed=cfg.seed,
            field="generation.backend",
            progress=bar.update,
        )
    return Table(outputs_table(rows, [o[0] for o in outs], config["generator"]), "outputs")


@stage_task(STAGES["write"])
def write_task(run: StageRun, config: dict, data: ArtifactRef) -> Table:
    """One answer per evaluation instruction from a writer of the synthetic farm (a fixed policy, no model).

    config: {"writer": a name of `synthetic.WRITERS`, "error_rate": its mistake rate, "generator": the name in the
    outputs table, "seed": one draw per row and seed}.
    """
    rows = split_rows(run.store.read_table(data), "eval")
    seed, writer, rate = config["seed"], config["writer"], float(config["error_rate"])
    outs = []
    for r in rows:
        if not r["task"]:
            raise ValueError(f"eval row {r['id']!r} has no synthetic task: the farm's writers need the synthetic farm")
        task = synthetic.task_from_json(r["task"])
        outs.append(synthetic.write(task, writer, rate, f"{seed}/{writer}/{rate}/{r['id']}"))
    return Table(outputs_table(rows, outs, config["generator"]), "outputs")  # its gold: the evaluate stage's


@stage_task(STAGES["evaluate"])
def evaluate_task(run: StageRun, config: AnnotatorConfig, outputs: ArtifactRef, data: ArtifactRef) -> Table:
    """Win rate of the outputs against the reference outputs (p_sim^eval)."""
    table, stats = evaluate_outputs(
        run.store.read_table(outputs).to_pylist(), split_rows(run.store.read_table(data), "eval"), config, run.store_uri
    )
    return Table(table, "evaluation", stats)
