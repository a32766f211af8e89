"""A traced model's fingerprint is the model's, not the device it was traced on (issue 45: a plan made
from the CPU-built model was refused for the same model built under ``torch.device("meta")``)."""

from __future__ import annotations

import pytest
import torch

from pipeline.runtime.trace.tracing import trace

pytest.importorskip("transformers")

from tests.hf_models import build


@pytest.mark.parametrize("name", ["llama", "bert"])
def test_a_model_built_on_meta_has_the_cpu_model_s_fingerprint(name: str) -> None:
    model, x, _ = build(name, 8)
    sample = x[0][:2] if len(x) == 1 else tuple(t[:2] for t in x)
    with torch.device("meta"):
        on_meta, _, _ = build(name, 8)
    meta_sample = (
        sample.to("meta") if isinstance(sample, torch.Tensor) else tuple(t.to("meta") for t in sample)
    )
    assert trace(model, sample).fingerprint == trace(on_meta, meta_sample).fingerprint


def test_another_model_still_has_another_fingerprint() -> None:
    model, x, _ = build("llama", 8)
    other, _, _ = build("gpt2", 8)
    sample = x[0][:2]
    assert trace(model, sample).fingerprint != trace(other, sample).fingerprint
