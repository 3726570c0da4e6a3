"""The learner's warm-up before a race (scripts/learner_warm_up.py): it loads the job's policy as a learner rank does
and runs its tokens through every decoder layer as a training step does (a forward without gradients, then a forward
and backward), leaving no gradients behind."""

import torch

from asyncrl.config import load_config
from learner.policy.memory import PROBE_SAMPLE_TOKENS, PROBE_TOKENS
from learner.policy.policy_trainer import PolicyTrainer
from learner_helpers import TINY_SHAPE, save_tiny_model, single_rank_world
from scripts.learner_warm_up import warm_up


def test_every_layer_runs_a_step_s_passes_once_and_the_gradients_are_dropped(tmp_path, monkeypatch):
    config = load_config(overrides=[f"model.path={save_tiny_model(tmp_path / 'model')}", "model.dtype=float32",
                                    "learner.device=cpu"])
    trainers, forward_tokens, backwards = [], [], []

    def load_and_watch(config, world):
        trainer = real_load(config, world)
        for layer in trainer.model.model.layers:
            layer.register_forward_hook(
                lambda _, inputs, __: forward_tokens.append((inputs[0].numel(), torch.is_grad_enabled())))
            layer.register_full_backward_hook(lambda *_: backwards.append(1))
        trainers.append(trainer)
        return trainer

    real_load = PolicyTrainer.load
    monkeypatch.setattr(PolicyTrainer, "load", load_and_watch)
    with single_rank_world() as world:
        assert warm_up(config, world) > 0
    # the first probe's 2,048 tokens, as rows of the model's context, through each layer without gradients, then with
    sample = min(PROBE_SAMPLE_TOKENS, trainers[0].model.config.max_position_embeddings)
    values = PROBE_TOKENS[0] // sample * sample * TINY_SHAPE.hidden_size
    assert forward_tokens == [(values, False)] * TINY_SHAPE.num_layers + [(values, True)] * TINY_SHAPE.num_layers
    assert len(backwards) == TINY_SHAPE.num_layers
    assert all(parameter.grad is None for parameter in trainers[0].model.parameters())
