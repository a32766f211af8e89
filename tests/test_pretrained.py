"""``Pipeline.load_pretrained``: a transformers model saved with ``save_pretrained``, read stage by stage.

The model is built on the meta device, partitioned, and each of 2 ranks builds its stages and reads
only their tensors from ``model.safetensors`` (one file) or from shards with their index. The step's
loss and gradients must equal one process running ``from_pretrained`` of the same folder; the tied
head gets the embedding's one entry on both ranks. Each rank's resident memory while loading is
measured (Linux's peak RSS, reset just before): it grows by at most its own stages, never the model.
Bad checkpoints get errors that name the key, and a step before the weights are loaded is refused.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from partitioner import partition, profile
from pipeline.plan import Plan
from pipeline.reference.hf import hf_init
from pipeline.runtime.inputs import pretrained
from pipeline.runtime.pipe import Pipeline
from tests.dist import job
from tests.hf_models import CausalLM, loss_of
from tests.pipe_common import assert_close

tf = pytest.importorskip("transformers")

B, M, T, V = 8, 4, 8, 1024


def _config() -> Any:
    return tf.LlamaConfig(
        vocab_size=V, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2, pad_token_id=0,
    )  # fmt: skip


def _meta() -> CausalLM:
    with torch.device("meta"):
        return CausalLM(tf.LlamaForCausalLM(_config()))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(1, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


@functools.cache
def _saved(root: Path) -> tuple[str, str]:
    """(one file, shards) folders of one seeded model."""
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(_config())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(root / "single")
        model.save_pretrained(root / "sharded", max_shard_size="4MB")
    return str(root / "single"), str(root / "sharded")


@functools.cache
def _plan(p: int) -> Plan:
    meta = _meta()
    sample = torch.randint(1, V, (B // M, T))
    found = profile(meta, sample, device="cpu", init_fn=hf_init(meta), warmup=0, repeat=1)
    # balanced by flops: measured times on a busy machine can put nearly every layer on one rank, and
    # the test needs stages smaller than the model
    return partition(meta, p, sample, n_microbatches=M, profile=found, cost="flops")


def _bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def _load_and_step(folders: tuple[str, ...], plan_json: str) -> list[Any]:
    """Per folder: (loss, gradients, bytes the load added to peak RSS, this rank's tensor bytes, the
    loss of a second meta-built pipeline that loads a DCP checkpoint the first saved)."""
    from pipeline import checkpointing

    out = []
    for folder in folders:
        model = _meta()
        pipe = Pipeline(
            model,
            Plan.from_json(plan_json),
            loss_fn=loss_of("llama"),
            init_fn=hf_init(model, pretrained=True),
        )
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak RSS starts again from the current RSS
        before = _bytes("VmRSS")
        pipe.load_pretrained(folder)
        grew = _bytes("VmHWM") - before
        own = sum(t.numel() * t.element_size() for t in [*pipe.parameters(), *pipe.buffers()])
        x, y = _batch()
        loss = pipe.step(x, y)
        grads = {k: p.grad.clone() for k, p in pipe.named_parameters() if p.grad is not None}
        checkpointing.save(Path(folder) / "dcp", 1, pipe=pipe, optimizer=torch.optim.AdamW(pipe.parameters()))
        pipe.close()
        model = _meta()
        again = Pipeline(
            model,
            Plan.from_json(plan_json),
            loss_fn=loss_of("llama"),
            init_fn=hf_init(model, pretrained=True),
        )
        opt = torch.optim.AdamW(again.parameters())
        checkpointing.load(Path(folder) / "dcp", pipe=again, optimizer=opt)  # the meta tensors' values too
        out.append((loss, grads, grew, own, again.step(x, y)))
        again.close()
    return out


_LOADED = job(2, _load_and_step, make_args=lambda f: (_saved(f.mktemp("pretrained")), _plan(2).to_json()),
              timeout=240.0, batch="hf")  # fmt: skip


def _one_rank_lacks_a_key(folders: tuple[str, ...], plan_json: str) -> str:
    """The last stage's rank reads a file without the final norm; the first rank, whose stages the
    file holds, steps. Each rank's error, as text: the first must name the second within seconds."""
    import time

    from safetensors.torch import load_file, save_file

    model = _meta()
    pipe = Pipeline(model, Plan.from_json(plan_json), loss_fn=loss_of("llama"),
                    init_fn=hf_init(model, pretrained=True), timeout=60.0)  # fmt: skip
    lacking = Path(folders[0]) / f"lacking{pipe.rank}.safetensors"
    tensors = load_file(str(Path(folders[0]) / pretrained.WEIGHTS))
    tensors.pop("model.norm.weight")
    save_file(tensors, str(lacking))
    start = time.monotonic()
    try:
        pipe.load_pretrained(lacking)
        pipe.step(*_batch())
    except Exception as exc:
        return f"{time.monotonic() - start:.1f}s {type(exc).__name__}: {exc}"
    finally:
        pipe.close()
    return "no error"


_LACKING = job(
    2, _one_rank_lacks_a_key, make_args=lambda f: (_saved(f.mktemp("lacking")), _plan(2).to_json()),
    timeout=240.0, batch="hf", last=True,
)  # fmt: skip


def test_a_rank_whose_file_lacks_a_key_is_named_on_the_others(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    first, last = _LACKING.results(tmp_path_factory)
    assert "ValueError" in last and "lacks 'model.norm.weight'" in last
    seconds, message = first.split("s ", 1)
    assert "rank 1 failed" in message and "lacks 'model.norm.weight'" in message, message
    assert float(seconds) < 10.0  # named, not left to wait for the pipeline's 60 s timeout


def _reference(folder: str) -> tuple[float, dict[str, torch.Tensor], int]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = CausalLM(tf.LlamaForCausalLM.from_pretrained(folder))
    x, y = _batch()
    losses = []
    for rows in torch.arange(B).chunk(M):
        loss = loss_of("llama")(model(x[rows]), y[rows])
        (loss / M).backward()
        losses.append(float(loss.detach()))
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return sum(losses) / M, grads, total


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="peak RSS reset is Linux's")
def test_each_rank_loads_its_stages_and_steps_as_one_process(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    results = _LOADED.results(tmp_path_factory)
    for f, folder in enumerate(_LOADED.args[0]):
        ref_loss, ref_grads, total = _reference(folder)
        grads: dict[str, torch.Tensor] = {}
        for r, per_folder in enumerate(results):
            loss, g, grew, own, resumed = per_folder[f]
            assert loss == pytest.approx(ref_loss, rel=1e-5), (folder, r)
            assert resumed == loss  # the checkpoint (trace constants not in it) restores every tensor
            assert_close(g, {k: ref_grads[k] for k in g}, f"{folder} rank {r}")
            grads.update(g)
            assert own < 0.8 * total, "the test needs stages smaller than the model"
            assert grew <= own + 2**21, f"rank {r} grew by {grew} bytes loading {own} of its own"
        assert set(grads) == set(ref_grads)  # the tied head: the embedding's entry, on both ranks
        assert "model.model.embed_tokens.weight" in results[0][f][1]
        assert "model.model.embed_tokens.weight" in results[1][f][1]


# ---- one rank, in this process: the errors


def _small(root: Path) -> tuple[str, nn.Module, Plan]:
    """A small saved Llama (untied), its folder, and a one-rank plan for a meta copy."""
    config = tf.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                            bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tf.LlamaForCausalLM(config).save_pretrained(root)
    with torch.device("meta"):
        meta = CausalLM(tf.LlamaForCausalLM(config))
    sample = torch.randint(1, 32, (2, 4))
    plan = partition(
        meta, 1, sample, profile=profile(meta, sample, device="cpu", init_fn=hf_init(meta), repeat=1)
    )
    return str(root), meta, plan


@pytest.fixture(scope="module")  # one saved model and plan: the tests only read them
def small(tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder, meta, plan = _small(tmp_path_factory.mktemp("small"))

    def fresh(change: Any = None) -> Pipeline:
        with torch.device("meta"):
            model = CausalLM(tf.LlamaForCausalLM(meta.model.config))
        if change is not None:
            change(model)  # on the meta model, before the pipeline materialises its stages
        return Pipeline(model, plan, loss_fn=loss_of("llama"), init_fn=hf_init(model, pretrained=True))

    return folder, fresh


def _rewrite(folder: str, out: Path, change: Any) -> Path:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(Path(folder) / pretrained.WEIGHTS))
    change(tensors)
    save_file(tensors, str(out))
    return out


def test_a_step_before_the_weights_are_loaded_is_refused(small: Any) -> None:
    folder, fresh = small
    pipe = fresh()
    x = torch.randint(1, 32, (2, 4))
    with pytest.raises(
        ValueError, match=r"left model\.model\..*without values.*pipe\.load_pretrained\(path\)"
    ):
        pipe.step(x, x)
    pipe = fresh()
    pipe.load_pretrained(folder)
    assert torch.isfinite(torch.tensor(pipe.step(x, x)))


def test_a_missing_key_is_named(small: Any, tmp_path: Path) -> None:
    folder, fresh = small
    path = _rewrite(folder, tmp_path / "m.safetensors", lambda t: t.pop("model.norm.weight"))
    with pytest.raises(
        ValueError, match=r"lacks 'model\.norm\.weight' \(the model's 'model\.model\.norm\.weight'"
    ):
        fresh().load_pretrained(path)


def test_an_unexpected_key_is_named_unless_not_strict(small: Any, tmp_path: Path) -> None:
    folder, fresh = small
    path = _rewrite(folder, tmp_path / "u.safetensors", lambda t: t.update(extra=torch.zeros(3)))
    with pytest.raises(ValueError, match=r"has the key 'extra', which names nothing in the model"):
        fresh().load_pretrained(path)
    fresh().load_pretrained(path, strict=False)


def test_names_under_no_prefix_ask_for_one(small: Any, tmp_path: Path) -> None:
    folder, fresh = small

    def rename(t: dict[str, torch.Tensor]) -> None:
        for k in list(t):
            t["other." + k] = t.pop(k)

    path = _rewrite(folder, tmp_path / "p.safetensors", rename)
    with pytest.raises(ValueError, match=r"match under no prefix: pass prefix="):
        fresh().load_pretrained(path)
    with pytest.raises(ValueError, match=r"has the key 'other\.[a-z_.]+', which names nothing"):
        fresh().load_pretrained(path, prefix="model.")  # a wrong prefix: every key is then unexpected


def test_a_wrong_shape_and_a_truncated_file_are_named(small: Any, tmp_path: Path) -> None:
    folder, fresh = small
    path = _rewrite(
        folder, tmp_path / "s.safetensors", lambda t: t.update({"model.norm.weight": torch.ones(3)})
    )
    with pytest.raises(
        ValueError, match=r"'model\.norm\.weight' has shape \[3\] but the model's tensor is \[16\]"
    ):
        fresh().load_pretrained(path)
    whole = (Path(folder) / pretrained.WEIGHTS).read_bytes()
    cut = tmp_path / "t.safetensors"
    cut.write_bytes(whole[:-100])
    with pytest.raises(ValueError, match=r"t\.safetensors is truncated"):
        fresh().load_pretrained(cut)
    with pytest.raises(FileNotFoundError, match=r"holds neither model\.safetensors nor"):
        fresh().load_pretrained(tmp_path)


def test_a_file_in_another_dtype_is_converted(small: Any, tmp_path: Path) -> None:
    """A bf16 checkpoint into a float32 model: each tensor through a buffer of the file's dtype."""
    folder, fresh = small

    def to_bf16(t: dict[str, torch.Tensor]) -> None:
        for k in t:
            t[k] = t[k].bfloat16()

    path = _rewrite(folder, tmp_path / "h.safetensors", to_bf16)
    pipe = fresh()
    pipe.load_pretrained(path)
    from safetensors.torch import load_file

    want = load_file(str(path))
    for name, p in pipe.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, want[name.removeprefix("model.")].float()), name


def test_the_prefix_maps_the_most_tensors_and_is_the_shortest_such() -> None:
    names = {"m.model.a.w": "m.model.a.w", "m.model.b.w": "m.model.b.w"}
    assert pretrained.find_prefix(names, {"model.a.w", "model.b.w", "b.w"}) == "m."  # 2 tensors, not 1
    assert pretrained.find_prefix({"a.w": "a.w"}, {"a.w", "w"}) == ""  # "" and "a." both map it
    assert pretrained.find_prefix(names, {"other"}) is None


def test_a_truncated_file_is_named_by_a_rank_that_reads_none_of_the_lost_bytes(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"a": torch.ones(2), "b": torch.ones(1000)}, str(tmp_path / "x.safetensors"))
    whole = (tmp_path / "x.safetensors").read_bytes()
    (tmp_path / "x.safetensors").write_bytes(whole[:-100])
    for wanted in ("a", "b"):  # whichever one's bytes come first in the file
        with pytest.raises(
            ValueError, match=r"x\.safetensors is truncated: \d+ bytes where its header needs"
        ):
            pretrained.load(tmp_path / "x.safetensors", {wanted: torch.zeros(2 if wanted == "a" else 1000)},
                            {"a": "a", "b": "b"})  # fmt: skip


def _file(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    save_file(tensors, str(path))
    return path


def test_an_index_that_names_the_wrong_file_and_many_missing_keys_are_named(tmp_path: Path) -> None:
    import json

    _file(tmp_path / "one.safetensors", {"a": torch.ones(2)})
    _file(tmp_path / "two.safetensors", {"b": torch.ones(3)})
    index = tmp_path / pretrained.INDEX
    index.write_text(json.dumps({"weight_map": {"a": "two.safetensors", "b": "one.safetensors"}}))
    with pytest.raises(
        ValueError, match=r"^the index names two\.safetensors for 'a', but that file does not"
    ):
        pretrained.load(tmp_path, {"a": torch.zeros(2)}, {"a": "a", "b": "b"})
    names = {f"w{k}": f"w{k}" for k in range(8)} | {"a": "a", "b": "b"}
    with pytest.raises(ValueError, match=r"lacks 'w0', 'w1', 'w2', 'w3', 'w4' and 3 more \(the model's 'w0'"):
        pretrained.load(tmp_path, {n: torch.zeros(1) for n in names}, names)


def test_a_tied_weight_takes_its_own_entry_before_an_alias(tmp_path: Path) -> None:
    """A file that holds both names of a tied weight (a tied config over an untied save): the
    weight's own name wins, as transformers' from_pretrained does, whichever comes first."""
    path = _file(
        tmp_path / "t.safetensors",
        {"lm_head.weight": torch.full((2,), 1.0), "model.embed.weight": torch.full((2,), 2.0)},
    )
    got = torch.zeros(2)
    names = {"model.embed.weight": "model.embed.weight", "lm_head.weight": "model.embed.weight"}
    pretrained.load(path, {"model.embed.weight": got}, names)  # the alias sorts first in the file
    assert torch.equal(got, torch.full((2,), 2.0))
    alone = _file(tmp_path / "a.safetensors", {"lm_head.weight": torch.full((2,), 1.0)})
    pretrained.load(alone, {"model.embed.weight": got}, names)
    assert torch.equal(got, torch.full((2,), 1.0))  # only the alias saved: it fills the weight


def test_a_non_persistent_buffer_in_the_file_is_skipped_and_a_float_never_becomes_an_int(
    small: Any, tmp_path: Path
) -> None:
    folder, fresh = small
    path = _rewrite(
        folder, tmp_path / "r.safetensors", lambda t: t.update({"model.rotary_emb.inv_freq": torch.ones(2)})
    )
    fresh().load_pretrained(path)  # older checkpoints hold the rotary table: no error, strict or not
    path = _rewrite(
        folder, tmp_path / "i.safetensors", lambda t: t.update({"model.norm.weight": torch.ones(16).long()})
    )
    with pytest.raises(
        ValueError, match=r"'model\.norm\.weight' is torch\.int64 but the model's tensor is torch\.float32"
    ):
        fresh().load_pretrained(path)


def test_unset_tensors_are_neither_gathered_nor_saved(small: Any, tmp_path: Path) -> None:
    from pipeline import checkpointing

    _, fresh = small
    pipe = fresh()
    with pytest.raises(ValueError, match=r"without values"):
        pipe.gather_state_dict()
    with pytest.raises(ValueError, match=r"without values"):
        checkpointing.save(tmp_path / "ckpt", 1, pipe=pipe, optimizer=torch.optim.AdamW(pipe.parameters()))
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


def test_a_strided_parameter_is_loaded_with_the_files_values(small: Any) -> None:
    """A parameter stored transposed (a non-contiguous view, which a meta model's materialisation
    keeps: ``empty_like`` preserves strides) gets the file's values, as ``from_pretrained`` gives."""
    folder, fresh = small
    name = "model.model.layers.0.mlp.up_proj.weight"

    def transpose(model: nn.Module) -> None:
        owner = model.get_submodule(name.rsplit(".", 1)[0])
        rows, cols = owner.weight.shape
        owner.weight = nn.Parameter(torch.empty(cols, rows, device="meta").t())  # strided

    pipe = fresh(transpose)
    assert not dict(pipe.named_parameters())[name].is_contiguous()  # materialised as it was
    pipe.load_pretrained(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = tf.LlamaForCausalLM.from_pretrained(folder).state_dict()
    got = dict(pipe.named_parameters())
    assert not got[name].is_contiguous() and torch.equal(got[name], ref[name.removeprefix("model.")])
    for key, t in got.items():
        assert torch.equal(t, ref[key.removeprefix("model.")]), key
