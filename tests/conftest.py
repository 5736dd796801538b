"""Shared fixtures. Tests never touch the network; models are tiny random ones or the embedded SmolLM2."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest


@pytest.fixture(scope="session")
def tokenizer():
    from tracegym.models import load_tokenizer

    return load_tokenizer("smollm2-135m")
