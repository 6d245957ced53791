"""objectives.tokens: completion_nll and token_logprobs against hand-computed values."""

import math

import pytest
import torch

from align.objectives.tokens import IGNORE, completion_nll, token_logprobs

LN2, LN3 = math.log(2.0), math.log(3.0)


def hand_batch(dtype=torch.float32):
    """B=2, T=4, V=3. labels[:, t] is scored by logits[:, t-1]; -100 marks prompt and padding.

    row 0: prompt, prompt, completion(1), completion(2)
    row 1: prompt, completion(0), completion(2), padding
    Scored positions (logits row -> target):
      logits[0,1] = [0, ln2, 0]  -> target 1: p = 2/4          -> nll ln 2
      logits[0,2] = [0, 0, 0]    -> target 2: p = 1/3          -> nll ln 3
      logits[1,0] = [ln3, 0, 0]  -> target 0: p = 3/(3+1+1)    -> nll ln(5/3)
      logits[1,1] = [0, 0, ln2]  -> target 2: p = 2/(1+1+2)    -> nll ln 2
    All other logits rows (predicting a -100 label, or the last position) are masked out.
    """
    junk = [7.0, -3.0, 2.0]
    logits = torch.tensor(
        [
            [junk, [0.0, LN2, 0.0], [0.0, 0.0, 0.0], junk],
            [[LN3, 0.0, 0.0], [0.0, 0.0, LN2], junk, junk],
        ],
        dtype=dtype,
    )
    labels = torch.tensor([[IGNORE, IGNORE, 1, 2], [IGNORE, 0, 2, IGNORE]])
    return logits, labels


# sum = ln2 + ln3 + ln(5/3) + ln2 = ln(2 * 3 * 5/3 * 2) = ln 20
EXPECTED_SUM = 2.995732273553991  # math.log(20)
EXPECTED_COUNT = 4  # 2 completion tokens in each row


def test_completion_nll_hand_values():
    logits, labels = hand_batch()
    nll, n = completion_nll(logits, labels)
    assert nll.item() == pytest.approx(EXPECTED_SUM, abs=1e-6)
    assert int(n) == EXPECTED_COUNT


def test_completion_nll_ignores_masked_positions():
    logits, labels = hand_batch()
    base, n0 = completion_nll(logits, labels)
    changed = logits.clone()
    # rows that predict a prompt/padding label, and the last position (predicts nothing)
    for b, t in [(0, 0), (0, 3), (1, 2), (1, 3)]:
        changed[b, t] = torch.tensor([100.0, -50.0, 3.0])
    nll, n = completion_nll(changed, labels)
    assert nll.item() == pytest.approx(base.item(), abs=1e-6) and int(n) == int(n0)
    # ...while changing a scored row does change it (the check above can fail)
    changed[0, 2] = torch.tensor([5.0, 0.0, 0.0])
    assert completion_nll(changed, labels)[0].item() > base.item() + 1.0


def test_completion_nll_gradient_by_hand():
    """d NLL / d logits[b, t] = softmax - onehot(target) on scored rows, 0 elsewhere."""
    logits, labels = hand_batch(torch.float64)
    logits.requires_grad_(True)
    completion_nll(logits, labels)[0].backward()
    expected = torch.zeros(2, 4, 3, dtype=torch.float64)
    expected[0, 1] = torch.tensor([1 / 4, 1 / 2 - 1, 1 / 4])
    expected[0, 2] = torch.tensor([1 / 3, 1 / 3, 1 / 3 - 1])
    expected[1, 0] = torch.tensor([3 / 5 - 1, 1 / 5, 1 / 5])
    expected[1, 1] = torch.tensor([1 / 4, 1 / 4, 1 / 2 - 1])
    torch.testing.assert_close(logits.grad, expected, atol=1e-6, rtol=0)


def test_completion_nll_gradcheck_fp64():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 3, dtype=torch.float64, requires_grad=True)
    _, labels = hand_batch()
    assert torch.autograd.gradcheck(lambda x: completion_nll(x, labels)[0], (logits,))


def test_completion_nll_gradcheck_fp32_tolerance():
    """Same check with finite differences large enough for the fp32 computation inside."""
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 3, dtype=torch.float64, requires_grad=True)
    _, labels = hand_batch()
    assert torch.autograd.gradcheck(lambda x: completion_nll(x, labels)[0], (logits,), eps=1e-3, atol=2e-3)


def test_token_logprobs_hand_value():
    # logits[0,0] = [0, ln2, 0], id 1 -> log(2/4) = -ln 2 = -0.6931471805599453
    # logits[0,1] = [ln3, 0, 0], id 0 -> log(3/5)        = -0.5108256237659907
    logits = torch.tensor([[[0.0, LN2, 0.0], [LN3, 0.0, 0.0]]])
    ids = torch.tensor([[1, 0]])
    for chunk in (1, 3, 1024):
        lp = token_logprobs(logits, ids, chunk=chunk)
        assert lp.shape == (1, 2) and lp.dtype == torch.float32
        torch.testing.assert_close(lp, torch.tensor([[-0.6931471805599453, -0.5108256237659907]]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("chunk", [1, 3, 1024])
def test_token_logprobs_matches_naive(chunk):
    torch.manual_seed(1)
    logits = torch.randn(2, 5, 7) * 3  # 10 rows: chunk 3 leaves a remainder of 1
    ids = torch.randint(0, 7, (2, 5))
    naive = torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)
    torch.testing.assert_close(token_logprobs(logits, ids, chunk=chunk), naive, atol=1e-5, rtol=0)


def test_token_logprobs_bf16_is_computed_in_fp32():
    torch.manual_seed(2)
    logits = (torch.randn(2, 3, 11) * 4).to(torch.bfloat16)
    ids = torch.randint(0, 11, (2, 3))
    naive = torch.log_softmax(logits.float(), -1).gather(-1, ids[..., None]).squeeze(-1)
    out = token_logprobs(logits, ids, chunk=4)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, naive, atol=1e-5, rtol=0)


def test_token_logprobs_gradcheck_fp64():
    torch.manual_seed(3)
    logits = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 4, (2, 3))
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, ids, chunk=4), (logits,))


def test_token_logprobs_gradcheck_fp32_tolerance():
    """Gradients flow through the chunked in-place writes (chunk 4 over 6 rows: two chunks)."""
    torch.manual_seed(3)
    logits = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 4, (2, 3))
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, ids, chunk=4), (logits,), eps=1e-3, atol=2e-3)
