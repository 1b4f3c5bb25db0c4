"""The in-process LLM judge itself: its identity, loading, prompts and forward pass (`farmflow.annotators.hf` runs it
over a preferences table with the row cache). A local causal LM's next-token probabilities, both orders averaged.

As alpaca_eval's weighted judges do, the judge is never sampled. The prompt (through the model's
chat template when it has one) shows the instruction, its input and outputs (a) and (b), asks which
is better and ends with the start of the answer, ``The better output is``; the two candidate
answers `` (a)`` and `` (b)`` are tokenized after it and their first differing token is the answer
token of each (whatever the tokenizer merges, e.g. `` (a`` or ``a``). One forward pass reads the
next-token log-probabilities at the last prompt position, renormalized over the two answer tokens.

Each pair is judged in both orders, so position bias cancels:
``P(output_1 better) = (p_1_shown_first + p_1_shown_second) / 2`` where ``p_1_shown_first`` is
P(a) with output_1 shown as (a) and ``p_1_shown_second`` is P(b) with output_1 shown as (b). The
preference is ``1 + P(output_2 better)`` in [1, 2] (1 = output_1 preferred, AlpacaFarm convention);
both per-order values go to the annotations cache and the preferences table. Since no order is
"the one shown", ``swapped`` is always False.

Prompts are left-padded into batches of `batch_size`, one forward pass each, logits of the last
position only, under `torch.inference_mode`. A prompt longer than the judge's context
(`max_prompt_tokens`, capped by the model's) has both outputs cut in the middle, marked in the text;
such pairs are counted (``truncated``) and logged, never an error.
"""

from __future__ import annotations

import copy
import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from jinja2 import TemplateError
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from farmflow.annotators.api import AnnotationError
from farmflow.config import HFJudgeConfig
from farmflow.modelcache import folder_digest, resolve_model
from farmflow.storage import canonical_json

# Bump when the prompt or the answer reading changes what the judge would say: it is part of the
# judge's identity, so the row cache never mixes answers to different prompts.
PROMPT_VERSION = "1"

SYSTEM = (
    "You judge answers written by AI assistants. You see an instruction, sometimes an input it refers to, and two "
    "candidate outputs labelled (a) and (b). Pick the output that carries out the instruction better: weigh "
    "correctness first, then helpfulness, completeness and clarity. The order of the outputs means nothing, and a "
    "longer output is not better for being longer."
)
QUESTION = "Which output is better, (a) or (b)? Answer with (a) or (b) only."
ANSWER_LEAD = "The better output is"
ANSWERS = (" (a)", " (b)")
CUT_MARK = " [... {n} tokens cut ...] "


# ----------------------------------------------------------------------------- identity and loading
def judge_source(cfg: HFJudgeConfig) -> str:
    """Where the judge's weights and tokenizer come from: a model-cache name's folder, a local folder or a hub id."""
    return resolve_model(cfg.model)


def judge_identity(cfg: HFJudgeConfig) -> dict:
    """Everything that changes the judge's answers: its files (a local folder's content digest) or hub id and
    revision, the GGUF file, dtype, prompt length cap and prompt version. Not batch size or device."""
    source = judge_source(cfg)
    if Path(source).is_dir():
        where = {"files": folder_digest(Path(source))}
    else:
        where = {"hub_id": source, "revision": cfg.revision}
    return {
        "kind": "hf",
        "prompt_version": PROMPT_VERSION,
        **where,
        "gguf_file": cfg.gguf_file,
        "dtype": cfg.dtype,
        "max_prompt_tokens": cfg.max_prompt_tokens,
    }


def judge_hash(cfg: HFJudgeConfig) -> str:
    """The judge's annotator hash in the row cache (and its part of the stage keys)."""
    return hashlib.sha256(canonical_json(judge_identity(cfg)).encode()).hexdigest()[:16]


def judge_name(cfg: HFJudgeConfig) -> str:
    """The `annotator` value of the judge's rows: ``hf:`` and the model's folder or hub name (its GGUF file's stem)."""
    return "hf:" + (Path(cfg.gguf_file).stem if cfg.gguf_file else Path(cfg.model).name or cfg.model)


@dataclass
class Judge:
    """A loaded judge: the model in eval mode, its tokenizer, whether prompts go through its chat template, and the
    longest prompt it reads (tokens)."""

    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    chat: bool
    limit: int
    forward_passes: int = 0
    prefix: tuple[tuple[int, ...], object] | None = None
    """The key/value cache of the prompts' shared opening (the judging guidance) and its token ids."""


def load_judge(cfg: HFJudgeConfig) -> Judge:
    """The judge of `cfg` (loaded once per process for the same identity and device)."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise AnnotationError(
            "annotation.hf.device: 'cuda' asked for, but this process sees no GPU (use 'auto' or 'cpu')"
        )
    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    return _load(
        judge_source(cfg), cfg.revision, cfg.gguf_file, cfg.dtype, device, cfg.max_prompt_tokens, judge_hash(cfg)
    )


@functools.lru_cache(maxsize=1)
def _load(
    source: str,
    revision: str | None,
    gguf_file: str | None,
    dtype: str,
    device: str,
    max_prompt_tokens: int,
    identity: str,
) -> Judge:
    # `identity` (judge_hash) only keys this cache: a folder whose files changed loads again
    kwargs = {"revision": revision} | ({"gguf_file": gguf_file} if gguf_file else {})
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, dtype), **kwargs)
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
        raise AnnotationError(
            f"annotation.hf.model: cannot load the judge {source!r}"
            + (f" (gguf_file {gguf_file!r})" if gguf_file else "")
            + f": {first}"
        ) from None
    context = getattr(model.config, "max_position_embeddings", None) or max_prompt_tokens
    return Judge(
        model.to(device).eval(),
        tokenizer,
        bool(getattr(tokenizer, "chat_template", None)),
        min(max_prompt_tokens, context),
    )


# ----------------------------------------------------------------------------- prompts
@dataclass(frozen=True)
class Prompt:
    """A tokenized judging prompt and the ids of its two answer tokens, (a) and (b)."""

    ids: list[int]
    answer_ids: tuple[int, int]


def render(judge: Judge, instruction: str, input: str, first: str, second: str) -> str:
    """The judging prompt's text, up to and including `ANSWER_LEAD` (the answer follows it)."""
    parts = ["## Instruction", instruction]
    if input:
        parts += ["## Input", input]
    parts += ["## Output (a)", first, "## Output (b)", second, "## Question", QUESTION]
    user = "\n\n".join(parts)
    if judge.chat:
        chat = functools.partial(judge.tokenizer.apply_chat_template, tokenize=False, add_generation_prompt=True)
        try:
            text = chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}])
        except TemplateError:  # a template without a system role: the guidance opens the user turn
            text = chat([{"role": "user", "content": f"{SYSTEM}\n\n{user}"}])
        return text + ANSWER_LEAD
    return f"{SYSTEM}\n\n{user}\n\n{ANSWER_LEAD}"


def encode(judge: Judge, text: str) -> Prompt:
    """The prompt's ids and answer tokens: both answers are tokenized after `text`, the prompt is their common prefix
    and each answer token the first one where they differ."""
    special = not judge.chat  # a chat template writes its special tokens itself
    a, b = (judge.tokenizer(text + answer, add_special_tokens=special)["input_ids"] for answer in ANSWERS)
    k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if k is None or k == 0:
        raise AnnotationError(
            f"annotation.hf.model: the tokenizer does not tell the answers {ANSWERS} apart after the prompt"
        )
    return Prompt(a[:k], (a[k], b[k]))


def cut_middle(tokenizer: PreTrainedTokenizerBase, ids: list[int], keep: int) -> str:
    """The text of `ids` with all but `keep` tokens cut from its middle, the cut marked."""
    head, tail = (keep + 1) // 2, keep // 2
    return (
        tokenizer.decode(ids[:head])
        + CUT_MARK.format(n=len(ids) - keep)
        + (tokenizer.decode(ids[len(ids) - tail :]) if tail else "")
    )


def fit(judge: Judge, instruction: str, input: str, output_1: str, output_2: str) -> tuple[list[Prompt], int]:
    """The pair's two prompts, (output_1, output_2) and (output_2, output_1), each within the judge's limit, and how
    many output tokens were cut. Both orders see the same cut outputs; the longer output is cut first."""

    def prompts(o1: str, o2: str) -> list[Prompt]:
        return [encode(judge, render(judge, instruction, input, a, b)) for a, b in ((o1, o2), (o2, o1))]

    both = prompts(output_1, output_2)
    over = max(len(p.ids) for p in both) - judge.limit
    if over <= 0:
        return both, 0
    t1, t2 = (judge.tokenizer(o, add_special_tokens=False)["input_ids"] for o in (output_1, output_2))
    over += 2 * len(judge.tokenizer(CUT_MARK.format(n=100000), add_special_tokens=False)["input_ids"])
    for _ in range(4):  # re-tokenizing the cut text can differ by a few tokens: cut more and try again
        budget = max(0, len(t1) + len(t2) - over)
        k1 = min(len(t1), max(budget // 2, budget - len(t2)))
        k2 = min(len(t2), budget - k1)
        o1 = output_1 if k1 == len(t1) else cut_middle(judge.tokenizer, t1, k1)
        o2 = output_2 if k2 == len(t2) else cut_middle(judge.tokenizer, t2, k2)
        both, cut = prompts(o1, o2), len(t1) - k1 + len(t2) - k2
        longest = max(len(p.ids) for p in both)
        if longest <= judge.limit:
            return both, cut
        if budget == 0:
            break
        over += longest - judge.limit
    # still too long (a very long instruction): keep each prompt's start and its end (the outputs' ends, the question)
    half = judge.limit // 2
    ends = [
        Prompt(p.ids[:half] + p.ids[len(p.ids) - (judge.limit - half) :], p.answer_ids)
        if len(p.ids) > judge.limit
        else p
        for p in both
    ]
    return ends, cut + longest - judge.limit


# ----------------------------------------------------------------------------- the forward pass
MIN_SHARED = 16
"""Shared opening tokens below which every prompt is read whole (a cache copy per batch is not worth fewer)."""


def shared_prefix(judge: Judge, prompts: Sequence[Prompt], device) -> tuple[tuple[int, ...], object]:
    """(the token ids every prompt opens with, their key/value cache), or ((), None) when they share fewer than
    `MIN_SHARED`. Each prompt keeps at least one token of its own (the last position's logits are its answer). The
    cache is kept on the judge: the same guidance in the next call is not read again."""
    if not prompts:
        return (), None
    first, n = prompts[0].ids, min(len(p.ids) for p in prompts) - 1
    k = next((i for i in range(n) if any(p.ids[i] != first[i] for p in prompts)), n)
    head = tuple(first[:k])
    if k < MIN_SHARED:
        return (), None
    if judge.prefix is not None and judge.prefix[0] == head:
        return head, judge.prefix[1]
    ids = torch.tensor([head], device=device)
    cache = judge.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True).past_key_values
    judge.forward_passes += 1
    judge.prefix = (head, cache)
    return head, cache


@torch.inference_mode()
def answer_probs(judge: Judge, prompts: Sequence[Prompt], batch_size: int) -> list[tuple[float, float]]:
    """(P(a) renormalized over the two answer tokens, the probability mass of the two) per prompt.

    Every prompt opens with the same judging guidance (about a third of a typical prompt's tokens), so that opening
    is read once and its key/value cache reused (`shared_prefix`); each prompt's own tokens follow it. Prompts are
    sorted by length and left-padded into batches of `batch_size` (the padding sits between the shared opening and the
    prompt's own tokens, masked); positions count real tokens only, so a prompt's answer does not depend on its batch.
    """
    device = next(judge.model.parameters()).device
    out: list[tuple[float, float]] = [(0.0, 0.0)] * len(prompts)
    head, cache = shared_prefix(judge, prompts, device)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i].ids))
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        own = [prompts[i].ids[len(head) :] for i in idx]
        width = max(len(o) for o in own)
        ids = torch.zeros(len(idx), width, dtype=torch.long)
        mask = torch.zeros(len(idx), len(head) + width, dtype=torch.long)
        mask[:, : len(head)] = 1
        for row, o in enumerate(own):
            ids[row, width - len(o) :] = torch.tensor(o)
            mask[row, len(head) + width - len(o) :] = 1
        position = (mask.cumsum(-1) - 1).clamp(min=0)[:, len(head) :]
        past = None
        if cache is not None:
            past = copy.deepcopy(cache)
            past.batch_repeat_interleave(len(idx))
        logits = (
            judge.model(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                position_ids=position.to(device),
                past_key_values=past,
                logits_to_keep=1,
                use_cache=past is not None,
            )
            .logits[:, -1]
            .float()
        )
        judge.forward_passes += 1
        logp = torch.log_softmax(logits, dim=-1)
        answers = torch.tensor([prompts[i].answer_ids for i in idx], device=logp.device)
        pair = logp.gather(1, answers)  # (batch, 2): log P(a), log P(b)
        p_a = torch.sigmoid(pair[:, 0] - pair[:, 1]).tolist()
        mass = pair.exp().sum(-1).tolist()
        for row, i in enumerate(idx):
            out[i] = (p_a[row], mass[row])
    return out


@dataclass
class Verdict:
    """One pair's judgement: P(output_1 better) with output_1 shown first / second, the answer tokens' probability mass
    in each order (how well the judge keeps to the answer format), the output tokens cut to fit and the two prompts'
    tokens."""

    p_1_shown_first: float
    p_1_shown_second: float
    mass_12: float
    mass_21: float
    cut_tokens: int
    prompt_tokens: int

    @property
    def preference(self) -> float:
        """1 + P(output_2 better), both orders averaged."""
        return 2.0 - (self.p_1_shown_first + self.p_1_shown_second) / 2


def judge_pairs(judge: Judge, pairs: Sequence[tuple[str, str, str, str]], batch_size: int) -> list[Verdict]:
    """Judge (instruction, input, output_1, output_2) pairs in both orders."""
    fitted = [fit(judge, *pair) for pair in pairs]
    probs = answer_probs(judge, [p for prompts, _ in fitted for p in prompts], batch_size)
    return [
        Verdict(
            probs[2 * k][0],
            1.0 - probs[2 * k + 1][0],
            probs[2 * k][1],
            probs[2 * k + 1][1],
            cut,
            sum(len(p.ids) for p in prompts),
        )
        for k, (prompts, cut) in enumerate(fitted)
    ]


__all__ = [
    "ANSWERS",
    "ANSWER_LEAD",
    "CUT_MARK",
    "Judge",
    "PROMPT_VERSION",
    "Prompt",
    "QUESTION",
    "SYSTEM",
    "Verdict",
    "answer_probs",
    "cut_middle",
    "encode",
    "fit",
    "judge_hash",
    "judge_identity",
    "judge_name",
    "judge_pairs",
    "judge_source",
    "load_judge",
    "render",
]
