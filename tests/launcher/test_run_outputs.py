"""What a run writes besides checkpoints: its DeepSpeed config (with the user's extra keys) and its wandb run."""

from __future__ import annotations

import pytest

from launcher.config import ConfigError, load_run_config
from parallel.ds_config import deepspeed_config


def test_extra_deepspeed_keys_are_merged_into_the_generated_config():
    cfg = load_run_config(
        None,
        [
            "model.preset=tiny",
            "parallel.zero_stage=2",
            "extra_deepspeed={comms_logger: {enabled: true, verbose: false},"
            " zero_optimization: {offload_optimizer: {device: cpu}}}",
        ],
    )
    ds = deepspeed_config(cfg.train, cfg.parallel, cfg.extra_deepspeed)
    assert ds["comms_logger"] == {"enabled": True, "verbose": False}
    # a new key inside a section the framework owns is added; the framework's own keys stay
    assert (
        ds["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
        and ds["zero_optimization"]["stage"] == 2
    )
    assert ds["train_micro_batch_size_per_gpu"] == cfg.train.micro_batch


def test_extra_deepspeed_keys_the_framework_owns_are_refused_with_the_setting_to_use():
    with pytest.raises(ConfigError) as err:
        load_run_config(
            None,
            [
                "model.preset=tiny",
                "extra_deepspeed={zero_optimization: {stage: 3},"
                " fp16: {enabled: true}, gradient_accumulation_steps: 4}",
            ],
        )
    msg = str(err.value)
    assert "3 problem(s)" in msg
    for needle in (
        "extra_deepspeed.zero_optimization.stage is set by the framework: use parallel.zero_stage",
        "extra_deepspeed.fp16 is set by the framework: use train.precision",
        "extra_deepspeed.gradient_accumulation_steps is set by the framework: use train.grad_accum",
    ):
        assert needle in msg, (needle, msg)


def test_a_resumed_run_continues_its_wandb_run(tmp_path):
    """Offline wandb: the second logger on the same run directory (a resume) reuses the first one's run id."""
    pytest.importorskip("wandb")
    from launcher.metrics import WANDB_ID_FILE, MetricsLogger

    cfg = load_run_config(
        None,
        [
            "model.preset=tiny",
            "logging.wandb_mode=offline",
            "logging.progress_bar=false",
            "logging.wandb_group=cmp",
            "logging.wandb_tags=[demix,test]",
        ],
    )
    ids = []
    for start in (0, 5):
        log = MetricsLogger(tmp_path, cfg, True, 10, start)
        assert log.wandb is not None
        ids.append(log.wandb.id)
        assert log.wandb.group == "cmp" and set(log.wandb.tags) == {"demix", "test"}
        log.log({"kind": "train", "step": start + 1, "loss": 1.0})
        log.close()
    assert ids[0] == ids[1] == (tmp_path / WANDB_ID_FILE).read_text().strip()
