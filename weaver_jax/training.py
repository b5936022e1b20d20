"""Training a drafter and a Weaver adapter for a target (what `weaver-jax train-*` runs).

    from weaver_jax import training
    data = training.load_dataset(training.generate_dataset(bundle, prompts, "data/train"))
    drafter, info = training.fit(drafter, training.drafter_loss_fn(config), data, config, "runs/drafter",
                                 frozen=(bundle.target,))
"""

from weaver_jax._prompts import evaluation_sets, stdlib_code_prompts, training_prompts
from weaver_jax._train import TrainConfig, adapter_loss, drafter_loss, fit, plot_log, read_log, restore, sample_anchors
from weaver_jax._train_data import generate_dataset, load_dataset


def drafter_loss_fn(config: TrainConfig):
    """`fit`'s loss for a drafter, frozen (target,)."""
    return lambda d, target, batch, key: drafter_loss(d, target, batch, key, anchors=config.anchors, gamma=config.gamma,
                                                      distill=config.distill)


def adapter_loss_fn(config: TrainConfig, pool_size: int):
    """`fit`'s loss for an adapter, frozen (target, drafter)."""
    return lambda a, target, drafter, batch, key: adapter_loss(a, target, drafter, batch, key, anchors=config.anchors,
                                                               gamma=config.gamma, pool_size=pool_size,
                                                               distill=config.distill)


__all__ = ["TrainConfig", "adapter_loss", "adapter_loss_fn", "drafter_loss", "drafter_loss_fn", "evaluation_sets",
           "fit", "generate_dataset", "load_dataset", "plot_log", "read_log", "restore", "sample_anchors",
           "stdlib_code_prompts", "training_prompts"]
