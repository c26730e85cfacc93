"""mp.global_token_count's counting and its one-line errors (no process group needed)."""

import pytest
import torch

import modelparallel as mp
from modelparallel.parallel import token_count

LABELS = torch.tensor([[5, 6, 7, -100], [-100, -100, -100, -100], [1, -100, 2, -100]])


def test_counts_the_targets_and_shift_drops_the_first_position_of_each_row():
    assert int(token_count.valid_targets(LABELS)) == 5
    assert int(token_count.valid_targets(LABELS, shift=True)) == 3  # HF shifts labels
    assert int(token_count.valid_targets(LABELS, ignore_index=7)) == 11  # -100 counts then


def test_before_init_it_says_to_call_init():
    assert not mp.is_initialized()
    with pytest.raises(mp.NotInitializedError, match=r"call mp.init\(config\) before using "
                                                     r"mp.global_token_count"):
        mp.global_token_count(LABELS)


@pytest.mark.parametrize(("labels", "message"), [
    (torch.randn(2, 3), "integer class labels, got a torch.float32 tensor: pass the labels"),
    ([1, 2, -100], "counts a tensor of labels, got list"),
])
def test_what_is_not_labels_is_refused_in_one_line(labels, message):
    with pytest.raises(TypeError, match=message) as raised:
        token_count.valid_targets(labels)
    assert "\n" not in str(raised.value)


def test_a_divisor_is_marked_for_the_tensor_parallel_batch_gathering():
    divisor = torch.tensor(2.5)
    assert not token_count.is_divisor(divisor)
    token_count.for_gathered_rows(divisor, 1)  # marks its result, not its argument
    assert not token_count.is_divisor(divisor)
    scaled = token_count.for_gathered_rows(torch.tensor(2.5), 4)
    assert token_count.is_divisor(scaled) and float(scaled) == 10.0
