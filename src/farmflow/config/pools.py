"""The API annotator pools of the paper, as plain data: `AnnotatorConfig.preset` names one of them."""

from __future__ import annotations


def _api(
    name: str, model: str, fmt: str, batch: int, style: str = "neutral", temperature: float = 1.0, paper: str = ""
) -> dict:
    return {
        "name": name,
        "model": model,
        "prompt_format": fmt,
        "batch_size": batch,
        "style": style,
        "temperature": temperature,
        "paper_name": paper,
    }


def _alpacafarm_pool() -> list[dict]:
    """13 annotators with the paper's mix (p_sim^eval): 5 GPT-4, 4 ChatGPT and 4 Davinci003 annotators × prompt formats
    × batch sizes, all at temperature 1.0. The 2023 models are retired; each maps to a current model of the same tier:
    gpt-4-0314 -> gpt-4o, gpt-3.5-turbo-0301 -> gpt-4o-mini, text-davinci-003 -> gpt-4.1-mini."""
    g4, g35, d3 = "gpt-4o", "gpt-4o-mini", "gpt-4.1-mini"
    return [
        _api("gpt4_1", g4, "json", 4, paper="gpt4_1: gpt-4-0314, chain-of-thought JSON, batch 4"),
        _api("gpt4_2", g4, "choice", 5, "strict", paper="gpt4_2: gpt-4-0314, short answer, persona prompt, batch 5"),
        _api("gpt4_3", g4, "choice", 5, paper="gpt4_3: gpt-4-0314, short answer, batch 5"),
        _api(
            "gpt4_4", g4, "choice", 1, "user", paper="gpt4_4: gpt-4-0314, chat prompt, favored answer tokens, batch 1"
        ),
        _api(
            "gpt4_5", g4, "choice", 5, "user", paper="gpt4_5: gpt-4-0314, short answer, second persona prompt, batch 5"
        ),
        _api("chatgpt_1", g35, "choice", 1, paper="chatgpt_1: gpt-3.5-turbo-0301, short answer, batch 1"),
        _api("chatgpt_2", g35, "json", 1, paper="chatgpt_2: gpt-3.5-turbo-0301, chain-of-thought JSON, batch 1"),
        _api("chatgpt_3", g35, "choice", 1, "strict", paper="chatgpt_3: gpt-3.5-turbo-0301, chat prompt, batch 1"),
        _api("chatgpt_4", g35, "logprobs", 1, paper="chatgpt_4: gpt-3.5-turbo-0301, older chat prompt, batch 1"),
        _api("davinci003_1", d3, "json", 4, "strict", paper="davinci003_1: text-davinci-003, reasoning, batch 4"),
        _api("davinci003_2", d3, "choice", 1, paper="davinci003_2: text-davinci-003, text prompt, batch 1"),
        _api("davinci003_3", d3, "choice", 5, paper="davinci003_3: text-davinci-003, text prompt, batch 5"),
        _api(
            "davinci003_4",
            d3,
            "logprobs",
            1,
            "user",
            paper="davinci003_4: text-davinci-003, older text prompt, batch 1",
        ),
    ]


ANNOTATOR_PRESETS: dict[str, dict] = {
    # name -> the fields a preset fixes (kind, api_pool, label_noise); see AnnotatorConfig.preset
    "alpacafarm-pool": {"kind": "api", "api_pool": _alpacafarm_pool(), "label_noise": 0.0},
    "p_sim_eval": {"kind": "api", "api_pool": _alpacafarm_pool(), "label_noise": 0.0},
    "p_sim_ann": {"kind": "api", "api_pool": _alpacafarm_pool(), "label_noise": 0.5},
    "p_sim_gpt4": {
        "kind": "api",
        "label_noise": 0.0,
        "api_pool": [
            _api(
                "gpt4_greedy",
                "gpt-4.1",
                "choice",
                5,
                temperature=0.0,
                paper="p_sim^GPT-4: gpt-4-0314, short answer, batch 5, temperature 0",
            )
        ],
    },
}
