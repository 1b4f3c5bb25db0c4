"""The Alpaca prompt format, used for every model input in both worlds."""

from __future__ import annotations

_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)


def format_prompt(instruction: str, input: str | None = "") -> str:
    """The Alpaca template; the variant without an input section when `input` is empty."""
    if input:
        return _WITH_INPUT.format(instruction=instruction, input=input)
    return _NO_INPUT.format(instruction=instruction)
