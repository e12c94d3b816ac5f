"""A micro-batch names the experts it is routed to: `to_model_batch` (and the tests' hand-built batches) set
"expert_ids", and the trainer reads them, never falling back to "domain_ids", which differ from them whenever the
experts come in another order than the data's domains (an init checkpoint's order)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from launcher.batches import expert_ids_of, step_expert_tokens, to_model_batch
from tests.conftest import random_lm_batch


def _sampler_batch() -> dict[str, torch.Tensor]:
    return {
        "tokens_BT": torch.zeros(3, 4, dtype=torch.long),
        "targets_BT": torch.zeros(3, 4, dtype=torch.long),
        "domain_ids_B": torch.tensor([0, 1, 2]),
        "loss_mask_BT": torch.tensor([[1.0] * 4, [1.0] * 4, [0.0, 1.0, 1.0, 1.0]]),
    }


def test_to_model_batch_sets_the_experts_of_the_domains():
    plan = SimpleNamespace(expert_of_domain=[2, 0, 1])  # experts in another order than the domains
    mb = to_model_batch(_sampler_batch(), torch.device("cpu"), plan)
    assert mb["domain_ids"].tolist() == [0, 1, 2]
    assert mb["expert_ids"].tolist() == [2, 0, 1]
    assert mb["expert_tokens"] == {2: 4.0, 0: 4.0, 1: 3.0}


def test_the_hand_built_batch_of_the_tests_sets_them():
    assert "expert_ids" in random_lm_batch(0, 2, 4, 16)


def _without_experts() -> dict[str, torch.Tensor]:
    mb = random_lm_batch(0, 2, 4, 16)
    del mb["expert_ids"]
    return mb


def test_a_batch_without_expert_ids_is_an_error_not_its_domains():
    mb = _without_experts()
    with pytest.raises(KeyError, match="no 'expert_ids'"):
        expert_ids_of(mb)
    with pytest.raises(KeyError, match="no 'expert_ids'"):
        step_expert_tokens([mb])  # no counts carried: they come from the routing ids


class _Engine:
    """Just enough of a DeepSpeed engine for `train_step` to reach its first forward, which it records."""

    def __init__(self) -> None:
        self.module, self.optimizer, self.forwards = torch.nn.Linear(1, 1), None, []

    def fp16_enabled(self) -> bool:
        return False

    def __call__(self, *args, **kwargs):
        self.forwards.append(args)
        raise AssertionError("the forward ran")


def test_train_step_refuses_a_batch_without_expert_ids():
    from launcher.train import train_step

    bundle = SimpleNamespace(engine=_Engine(), expert_scale=None)
    with pytest.raises(KeyError, match="no 'expert_ids'"):
        train_step(bundle, SimpleNamespace(), [_without_experts()], 1)
    assert bundle.engine.forwards == []
