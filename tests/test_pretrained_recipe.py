"""The README's pretrained recipe, run as written: the block after its ``<!-- recipe: pretrained`` marker,
copied verbatim to a file and run as ``python3 recipe.py FOLDER`` on a small Gemma2 saved there (no
network). Gemma2 needs what no checkpoint holds, its ``embed_scale`` and rotary table, from the recipe's
``init_fn``; the 2 ranks' losses over its AdamW steps equal one process training ``from_pretrained``'s
model on the same batches, and its checkpoint is written.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pipeline.reference.hf import CausalLM

tf = pytest.importorskip("transformers")

README = Path(__file__).parents[1] / "README.md"
MARKER = "<!-- recipe: pretrained"
STEPS, B, M, T = 3, 8, 4, 32  # what the recipe runs: 3 steps of (8, 33) ids, 4 micro-batches


def recipe() -> str:
    """The README's python block that follows the marker, verbatim."""
    text = README.read_text()
    found = re.search(re.escape(MARKER) + r"[^\n]*-->\n```python\n(.*?)\n```\n", text, re.S)
    if found is None:
        raise AssertionError(f"README.md has no ```python block right after {MARKER!r}")
    return found.group(1) + "\n"


def test_the_readme_marks_one_recipe_and_it_is_a_script() -> None:
    assert README.read_text().count(MARKER) == 1
    tree = ast.parse(recipe())  # valid Python, run under a main guard (its ranks re-import it)
    assert any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) for node in tree.body)


def _save(folder: Path) -> None:
    """A small Gemma2 whose weights are all moved off their initial values (norms start at zero)."""
    config = tf.Gemma2Config(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=4, sliding_window=8, max_position_embeddings=64, bos_token_id=1,
        eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tf.Gemma2ForCausalLM(config)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        model.save_pretrained(folder)


def _one_process(folder: Path) -> list[float]:
    """The recipe's training in one process: from_pretrained, the same batch, micro-batches, clip, AdamW."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = CausalLM(tf.AutoModelForCausalLM.from_pretrained(folder))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(model.model.config.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(0))
    x, y = ids[:, :-1], ids[:, 1:]
    losses = []
    for _ in range(STEPS):
        total = 0.0
        for rows in torch.arange(B).chunk(M):
            loss = F.cross_entropy(model(x[rows]).flatten(0, 1), y[rows].flatten())
            (loss / M).backward()
            total += float(loss.detach()) / M
        losses.append(total)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return losses


@pytest.mark.slow  # an end-to-end script run; test_pretrained_models covers the library
def test_the_readme_recipe_runs_as_written_and_trains_as_one_process(tmp_path: Path) -> None:
    _save(tmp_path / "gemma2")
    (tmp_path / "recipe.py").write_text(recipe())
    env = {**os.environ, "PYTHONPATH": str(README.parent), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "recipe.py", "gemma2"], env=env, cwd=tmp_path, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    losses = ast.literal_eval(done.stdout.strip().splitlines()[-1])  # rank 0's, as the recipe prints
    assert losses == pytest.approx(_one_process(tmp_path / "gemma2"), rel=1e-5)
    assert "cuts before model.model.layers." in done.stdout  # its plan: 2 stages
    assert (tmp_path / "runs" / "pretrained" / f"step-{STEPS:08d}").is_dir()
