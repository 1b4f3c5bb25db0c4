"""The two losses, checked against hand computations."""

import math

import pytest
import torch

from farmflow.methods.reward import bradley_terry_loss
from farmflow.methods.sft import sft_loss


def log_sigmoid(x: float) -> float:
    return -math.log(1.0 + math.exp(-x))


# ----------------------------------------------------------------------------- Bradley-Terry


def test_bradley_terry_hand_computed():
    # r1 = [0, 1], r2 = [1, -1], pref = [2, 1]
    # pair 0: output_2 preferred (target 1), d = r2 - r1 = 1   -> -log σ(1)
    # pair 1: output_1 preferred (target 0), d = -1 - 1 = -2  -> -log(1 - σ(-2)) = -log σ(2)
    expected = (-log_sigmoid(1.0) - log_sigmoid(2.0)) / 2
    assert expected == pytest.approx((math.log(1 + math.exp(-1)) + math.log(1 + math.exp(-2))) / 2)
    assert expected == pytest.approx(0.2200948, abs=1e-6)
    loss = bradley_terry_loss(torch.tensor([0.0, 1.0]), torch.tensor([1.0, -1.0]), torch.tensor([2, 1]))
    assert loss.item() == pytest.approx(expected, rel=1e-6)


def test_bradley_terry_equal_rewards_is_log_2():
    loss = bradley_terry_loss(torch.zeros(3), torch.zeros(3), torch.tensor([1.0, 2.0, 1.5]))
    assert loss.item() == pytest.approx(math.log(2), rel=1e-6)


def test_bradley_terry_fractional_preferences():
    # pref 1.5 -> target 0.5, pref 1.25 -> target 0.25; BCE(t, d) = -t log σ(d) - (1 - t) log σ(-d)
    r1 = torch.tensor([0.5, 2.0])
    r2 = torch.tensor([1.5, 1.0])
    pref = torch.tensor([1.5, 1.25])
    d0, d1 = 1.0, -1.0
    l0 = -0.5 * log_sigmoid(d0) - 0.5 * log_sigmoid(-d0)
    l1 = -0.25 * log_sigmoid(d1) - 0.75 * log_sigmoid(-d1)
    assert bradley_terry_loss(r1, r2, pref).item() == pytest.approx((l0 + l1) / 2, rel=1e-6)

    # a tie's loss is minimal when the rewards are equal
    def tie(d):
        return bradley_terry_loss(torch.tensor([0.0]), torch.tensor([d]), torch.tensor([1.5])).item()

    assert tie(0.0) < tie(0.3) and tie(0.0) < tie(-0.3)
    assert tie(0.3) == pytest.approx(tie(-0.3), rel=1e-6)


def test_bradley_terry_is_scalar_and_symmetric():
    r1, r2 = torch.tensor([0.3, -0.7, 2.0]), torch.tensor([1.1, 0.4, -0.5])
    pref = torch.tensor([1.0, 2.0, 1.25])
    loss = bradley_terry_loss(r1, r2, pref)
    assert loss.dim() == 0 and loss.shape == torch.Size([])
    assert loss.dtype == torch.float32
    # swapping the outputs and mirroring the preference (p -> 3 - p) gives the same loss
    assert bradley_terry_loss(r2, r1, 3.0 - pref).item() == pytest.approx(loss.item(), rel=1e-6)


def test_bradley_terry_integer_preference_with_float64_rewards():
    loss = bradley_terry_loss(
        torch.tensor([0.0], dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64), torch.tensor([2])
    )
    assert loss.dtype == torch.float64
    assert loss.item() == pytest.approx(-log_sigmoid(1.0), rel=1e-12)


def test_bradley_terry_gradient_sign():
    r1 = torch.tensor([0.2, 0.1], requires_grad=True)
    r2 = torch.tensor([-0.3, 0.4], requires_grad=True)
    pref = torch.tensor([2.0, 1.0])  # pair 0: output_2 preferred; pair 1: output_1 preferred
    bradley_terry_loss(r1, r2, pref).backward()
    # increasing the preferred output's reward lowers the loss (negative gradient),
    # increasing the rejected one's raises it
    assert r2.grad[0] < 0 and r1.grad[0] > 0
    assert r1.grad[1] < 0 and r2.grad[1] > 0
    # exact: d/d r2 of mean BCE = (σ(d) - t) / N
    d0 = -0.3 - 0.2
    assert r2.grad[0].item() == pytest.approx((1 / (1 + math.exp(-d0)) - 1) / 2, rel=1e-5)
    # and a step along the preferred reward lowers the loss
    with torch.no_grad():
        before = bradley_terry_loss(r1, r2, pref).item()
        after = bradley_terry_loss(r1, r2 + torch.tensor([0.1, 0.0]), pref).item()
    assert after < before


# ----------------------------------------------------------------------------- SFT


def log_softmax(row: list[float], i: int) -> float:
    return row[i] - math.log(sum(math.exp(x) for x in row))


LOGITS = [
    [1.0, 2.0, 0.5, -1.0],  # position 0 predicts labels[1]
    [0.0, -0.5, 3.0, 1.0],  # position 1 predicts labels[2]
    [9.0, -9.0, 9.0, -9.0],  # position 2 predicts nothing (no next label)
]


def test_sft_loss_only_response_positions_count():
    logits = torch.tensor([LOGITS])
    labels = torch.tensor([[-100, -100, 2]])  # prompt, prompt, response token 2
    expected = -log_softmax(LOGITS[1], 2)
    assert expected == pytest.approx(0.1950072, abs=1e-6)  # 3 - log(1 + e^-0.5 + e^3 + e)
    loss = sft_loss(logits, labels)
    assert loss.dim() == 0
    assert loss.item() == pytest.approx(expected, rel=1e-6)


def test_sft_loss_mean_over_response_tokens():
    logits = torch.tensor([LOGITS])
    labels = torch.tensor([[-100, 1, 3]])  # position 0 -> token 1, position 1 -> token 3
    expected = (-log_softmax(LOGITS[0], 1) - log_softmax(LOGITS[1], 3)) / 2
    assert sft_loss(logits, labels).item() == pytest.approx(expected, rel=1e-6)
    # the first label is never a target (nothing predicts it) and the last logits are unused
    labels_first = torch.tensor([[0, 1, 3]])
    other_last = torch.tensor([LOGITS[:2] + [[-5.0, 5.0, 0.0, 0.0]]])
    assert sft_loss(logits, labels_first).item() == pytest.approx(expected, rel=1e-6)
    assert sft_loss(other_last, labels).item() == pytest.approx(expected, rel=1e-6)


def test_sft_loss_averages_over_tokens_not_sequences():
    # row 0 has 2 response tokens, row 1 has 1: the mean is over the 3 tokens
    logits = torch.tensor([LOGITS, LOGITS])
    labels = torch.tensor([[-100, 1, 3], [-100, -100, 0]])
    expected = (-log_softmax(LOGITS[0], 1) - log_softmax(LOGITS[1], 3) - log_softmax(LOGITS[1], 0)) / 3
    assert sft_loss(logits, labels).item() == pytest.approx(expected, rel=1e-6)


def test_sft_loss_upcasts_half_precision():
    logits = torch.tensor([LOGITS], dtype=torch.bfloat16)
    loss = sft_loss(logits, torch.tensor([[-100, -100, 2]]))
    assert loss.dtype == torch.float32


def test_pairwise_accuracy_skips_ties_in_labels_and_rewards():
    from farmflow.evaluation.reward_report import pairwise_accuracy

    r1 = [0.0, 1.0, 0.5, 0.2, 0.3]
    r2 = [1.0, 0.0, 0.5, 0.9, 0.1]
    prefs = [2.0, 2.0, 1.0, 1.5, 1.0]
    # pair 0 right, pair 1 wrong, pair 2 reward tie (skipped), pair 3 label tie (skipped), pair 4 right
    assert pairwise_accuracy(r1, r2, prefs) == pytest.approx(2 / 3)
    assert math.isnan(pairwise_accuracy([0.0], [0.0], [2.0]))


def test_heldout_accuracies_split_noised_and_gold():
    from farmflow.tasks import heldout_accuracies

    rows = [
        {"preference": 2.0, "noised": False, "gold_1": 0.0, "gold_2": 1.0},  # right on all three
        {"preference": 1.0, "noised": True, "gold_1": 0.0, "gold_2": 1.0},  # coin flip says 1; gold says 2
        {"preference": 1.0, "noised": False, "gold_1": 0.5, "gold_2": 0.5},  # gold tie: not in gold accuracy
        {"preference": 2.0, "noised": False, "gold_1": 1.0, "gold_2": 0.0},  # annotator disagrees with gold
    ]
    r1, r2 = [0.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 1.0]  # the model prefers output_2 except on row 2
    acc = heldout_accuracies(rows, r1, r2)
    assert acc["heldout_accuracy"] == pytest.approx(3 / 4)
    assert acc["heldout_accuracy_unnoised"] == pytest.approx(3 / 3)
    assert acc["heldout_gold_accuracy"] == pytest.approx(2 / 3)


# ------------------------------------------------------------------------- DPO
def test_dpo_loss_hand_computed():
    from farmflow.methods.dpo import dpo_loss

    pc, pr = torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -1.0])
    rc, rr = torch.tensor([-1.5, -2.0]), torch.tensor([-2.5, -1.5])
    # margins: (-1 + 1.5) - (-3 + 2.5) = 1.0 and (-2 + 2) - (-1 + 1.5) = -0.5; beta 0.5 scales them
    expected = (-math.log(1 / (1 + math.exp(-0.5))) - math.log(1 / (1 + math.exp(0.25)))) / 2
    loss = dpo_loss(pc, pr, rc, rr, beta=0.5)
    assert loss.dim() == 0
    assert loss.item() == pytest.approx(expected, rel=1e-6)


def test_dpo_loss_default_beta_and_equal_policy_is_log_2():
    from farmflow.methods.dpo import dpo_loss

    x, y = torch.tensor([-4.0, -7.0, -1.0]), torch.tensor([-2.0, -9.0, -3.0])
    assert dpo_loss(x, y, x, y).item() == pytest.approx(math.log(2), rel=1e-6)
    # default beta is 0.1: a margin of 10 nats gives -log sigmoid(1)
    z = torch.zeros(1)
    assert dpo_loss(torch.tensor([10.0]), z, z, z).item() == pytest.approx(math.log(1 + math.exp(-1.0)), rel=1e-6)


def test_dpo_loss_gradient_raises_chosen_lowers_rejected():
    from farmflow.methods.dpo import dpo_loss

    pc, pr = torch.tensor([-2.0], requires_grad=True), torch.tensor([-2.0], requires_grad=True)
    dpo_loss(pc, pr, torch.tensor([-2.0]), torch.tensor([-2.0])).backward()
    assert pc.grad.item() < 0 < pr.grad.item()  # descent raises log pi(chosen), lowers log pi(rejected)
    assert pc.grad.item() == pytest.approx(-0.05)  # -beta * sigmoid(0) = -0.1 * 0.5
