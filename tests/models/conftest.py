"""Models for tests/models, built once per session (random weights from a seed; the tests
never change them: every patch of the references is undone on exit)."""

import pytest


def _model(name, **overrides):
    from cpplan.models import build_model, preset_config

    return build_model(preset_config(name, **overrides), seed=0)


@pytest.fixture(scope="session")
def tiny_models():
    """model name -> (topk 32: below the tests' longer contexts, topk 128: above all)."""
    return {name: (_model(name), _model(name, index_topk=128))
            for name in ("tiny-deepseek-v32", "tiny-glm-5")}
