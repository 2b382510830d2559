"""Bad batches fail with an error naming the field and the sequence."""

import pytest
import torch

from megarl.batch import BatchValidationError, from_sequences, validate_groups


def good():
    return from_sequences([[1, 2], [1, 2], [3]], [[4, 5, 6], [7], [8, 9]], [0, 0, 1], rewards=[1.0, 0.0, 1.0])


def test_good_batch_passes():
    b = good()
    assert b.num_seqs == 3 and b.num_tokens == 11
    assert b.response_lens().tolist() == [3, 1, 2]
    validate_groups(b)


@pytest.mark.parametrize(
    "mutate, field, seq",
    [
        (lambda b: setattr(b, "rewards", torch.tensor([1.0, float("nan"), 0.0])), "rewards", 1),
        (lambda b: setattr(b, "rewards", torch.tensor([1.0, 0.0])), "rewards", None),
        (lambda b: setattr(b, "loss_mask", torch.ones(11)), "loss_mask", 0),
        (lambda b: setattr(b, "old_logprobs", torch.zeros(10)), "old_logprobs", None),
        (lambda b: setattr(b, "advantages", torch.tensor([0.0] * 9 + [float("inf"), 0.0])), "advantages", 2),
        (
            lambda b: setattr(b, "rollout_logprobs", torch.tensor([0.0] * 3 + [0.5] + [0.0] * 7)),
            "rollout_logprobs",
            0,
        ),
        (lambda b: setattr(b, "cu_seqlens", torch.tensor([0, 5, 6, 12])), "cu_seqlens", None),
        (lambda b: setattr(b, "prompt_lens", torch.tensor([2, 9, 1])), "prompt_lens", 1),
        (lambda b: setattr(b, "turn_spans", [[(0, 5, "a")], [(0, 9, "a")], []]), "turn_spans", 1),
        (lambda b: setattr(b, "tokens", b.tokens.float()), "tokens", None),
    ],
)
def test_bad_field_is_named(mutate, field, seq):
    b = good()
    mutate(b)
    with pytest.raises(BatchValidationError) as e:
        b.validate()
    assert f"field '{field}'" in str(e.value)
    if seq is not None:
        assert f"sequence {seq}" in str(e.value)


def test_mask_inside_prompt_is_rejected():
    b = good()
    b.loss_mask[1] = 1.0  # second prompt token of sequence 0
    with pytest.raises(BatchValidationError, match="sequence 0: token 1 is inside the prompt"):
        b.validate()


def test_empty_group_is_rejected():
    b = from_sequences([[1], [1], [2]], [[3], [4], []], [0, 0, 1])
    with pytest.raises(BatchValidationError, match="sequence 2: group 1 has no loss token"):
        validate_groups(b)


def test_small_group_is_rejected():
    with pytest.raises(BatchValidationError, match="group 1 has 1 sequence"):
        validate_groups(good(), min_group_size=2)
