"""``hf_init`` and ``load_pretrained`` beyond Llama: Gemma's ``embed_scale``, Gemma3's two rotary tables,
an encoder-decoder's tied embeddings and persistent buffer.

    # B: batch, T: tokens, S: source tokens, V: vocabulary

``hf_init(model)`` gives a meta-built model's stages the values transformers gives them: its computed
buffers equal those of the model built on the CPU, bit for bit and dtype for dtype, for Llama (llama3
rope scaling), Gemma, Gemma2, Gemma3, BERT, BERT in an EncoderDecoderModel, BART and T5, in fp32 and
bf16; on the model's own modules and on copies of them (a profiled layer), whose buffers come from the
transformers model nearest them (the EncoderDecoderModel's own dispatch finds no copy).
``pretrained=True`` writes only what no checkpoint holds.

Gemma2 (tied head, sliding window, soft-capping) and BART (an encoder-decoder: one embedding tied four
ways, ``final_logits_bias``) are saved with every weight and persistent buffer perturbed off its
initial value, then loaded into 2 ranks' stages: every parameter and buffer equals ``from_pretrained``'s
bit for bit, and a step's loss and gradients equal one process on the loaded model.
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeline.launch import FORKSERVER_PRELOAD
from pipeline.plan import Plan
from pipeline.reference.hf import CausalLM, Seq2SeqLM, hf_init
from pipeline.runtime.trace.materialize import materialize
from tests.dist import job
from tests.pipe_common import assert_close

tf = pytest.importorskip("transformers")

B, M, T, V = 4, 2, 8, 64
_TOKENS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
_DECODER = dict(vocab_size=V, hidden_size=16, intermediate_size=32, num_attention_heads=4,
                num_key_value_heads=1, head_dim=4, max_position_embeddings=32, **_TOKENS)  # fmt: skip
_BART = dict(vocab_size=V, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
             decoder_attention_heads=4, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32,
             dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, **_TOKENS)  # fmt: skip
_BERT = dict(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32,
             max_position_embeddings=32, pad_token_id=0)  # fmt: skip
_T5 = dict(vocab_size=V, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=4, dropout_rate=0.0,
           decoder_start_token_id=0, **_TOKENS)  # fmt: skip
_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16}  # fmt: skip

# name -> the transformers model, as built (meta or CPU: the caller's device)
MODELS: dict[str, Callable[[], nn.Module]] = {
    "llama": lambda: tf.LlamaForCausalLM(
        tf.LlamaConfig(
            num_hidden_layers=2,
            rope_parameters={**_LLAMA3_ROPE, "rope_theta": 500000.0},
            **{k: v for k, v in _DECODER.items() if k != "head_dim"},
        )
    ),
    "gemma": lambda: tf.GemmaForCausalLM(tf.GemmaConfig(num_hidden_layers=2, **_DECODER)),
    "gemma2": lambda: tf.Gemma2ForCausalLM(
        tf.Gemma2Config(num_hidden_layers=2, sliding_window=4, **_DECODER)
    ),
    "gemma3": lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(num_hidden_layers=7, **_DECODER)),  # 2 ropes
    "bert": lambda: tf.BertForMaskedLM(tf.BertConfig(**_BERT)),  # integer buffers: position, token type ids
    "bert2bert": lambda: tf.EncoderDecoderModel(  # a transformers model in each of two others
        config=tf.EncoderDecoderConfig.from_encoder_decoder_configs(
            tf.BertConfig(**_BERT), tf.BertConfig(**_BERT, is_decoder=True, add_cross_attention=True)
        )
    ),
    "bart": lambda: tf.BartForConditionalGeneration(tf.BartConfig(**_BART)),
    "t5": lambda: tf.T5ForConditionalGeneration(tf.T5Config(**_T5)),
}
FORKSERVER_PRELOAD += ["transformers.models.gemma2.modeling_gemma2", "transformers.models.bart.modeling_bart"]


def _quiet(make: Callable[[], Any]) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' notes on small configs
        return make()


def _built(name: str, device: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return _quiet(MODELS[name])  # type: ignore[no-any-return]
    finally:
        torch.set_default_dtype(before)


def _non_persistent(model: nn.Module) -> dict[str, torch.Tensor]:
    held = model.state_dict(keep_vars=True)
    return {n: b for n, b in model.named_buffers() if n not in held}


# ---- hf_init, in this process


def _materialized(name: str, dtype: torch.dtype, init_fn: Any) -> tuple[nn.Module, set[str]]:
    """The model built on meta and materialised on the CPU with ``init_fn``; the names left unset."""
    meta = _built(name, "meta", dtype)
    unset: dict[int, str] = {}
    materialize([meta], "cpu", init_fn(meta), unset)
    return meta, {text.split(" ")[0] for text in unset.values()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(MODELS))
def test_hf_init_computes_the_buffers_of_the_model_built_on_the_cpu(name: str, dtype: torch.dtype) -> None:
    cpu = _non_persistent(_built(name, "cpu", dtype))
    assert name in ("bert", "bert2bert", "bart", "t5") or {"model.rotary_emb"} <= {
        n.rsplit(".", 1)[0] for n in cpu
    }
    assert name not in ("gemma", "gemma2", "gemma3") or "model.embed_tokens.embed_scale" in cpu
    _, blank = _materialized(name, dtype, lambda meta: None)  # what no reset_parameters writes
    for pretrained in (False, True):
        meta, unset = _materialized(name, dtype, functools.partial(hf_init, pretrained=pretrained))
        got = _non_persistent(meta)
        assert list(got) == list(cpu)
        for key, want in cpu.items():
            assert got[key].dtype == want.dtype and torch.equal(got[key], want), (name, key, pretrained)
        # pretrained: what a checkpoint holds and no reset_parameters writes (a norm's scale, BART's
        # bias) is left for the load (a step refuses until then); else every tensor has values
        assert unset == (blank - set(cpu) if pretrained else set()), name
        assert not any(hasattr(t, "_is_hf_initialized") for t in [*meta.parameters(), *meta.buffers()])


@pytest.mark.parametrize(
    ("name", "paths"),
    [
        ("gemma2", ("model.embed_tokens", "model.rotary_emb")),
        ("gemma3", ("model.embed_tokens", "model.rotary_emb")),
        ("bert2bert", ("encoder.embeddings", "decoder.bert.embeddings")),
    ],
)
def test_hf_init_matches_copies_of_the_models_modules_by_class(name: str, paths: tuple[str, ...]) -> None:
    """partition profiles copies of each layer: their modules are not the model's, their classes are."""
    cpu = _built(name, "cpu")
    meta = _built(name, "meta")
    init = hf_init(meta)
    for path in paths:
        work = copy.deepcopy(meta.get_submodule(path))
        materialize([work], "cpu", init)  # a buffer left blank would raise
        for key, want in _non_persistent(cpu.get_submodule(path)).items():
            assert torch.equal(dict(work.named_buffers())[key], want), (path, key)


def test_hf_init_refuses_a_model_holding_no_transformers_model() -> None:
    with pytest.raises(
        ValueError, match=r"hf_init takes a model holding transformers models.*got Sequential"
    ):
        hf_init(nn.Sequential(nn.Linear(2, 2)))


# ---- load_pretrained, 2 ranks against one process


def _wrapped(name: str, model: nn.Module) -> nn.Module:
    return Seq2SeqLM(model) if name == "bart" else CausalLM(model)


def _batch(name: str) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (B, T), generator=g)  # (B, T)
    inputs = (torch.randint(3, V, (B, T + 2), generator=g), ids) if name == "bart" else (ids,)  # (B, S)
    return inputs, torch.randint(0, V, (B, T), generator=g)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())  # (B * T, V) against (B * T,)


def _save(name: str, folder: Path) -> str:
    """A seeded model with every weight and persistent buffer moved off its initial value (zeros, ones)
    so that a load that misses one is seen; the computed buffers are left as transformers makes them."""
    torch.manual_seed(0)
    model = _built(name, "cpu")
    with torch.no_grad():
        for t in model.state_dict(keep_vars=True).values():
            t.add_(torch.randn_like(t))
    _quiet(lambda: model.save_pretrained(folder))
    return str(folder)


@functools.cache
def _plan(name: str) -> Plan:
    from partitioner import partition, profile

    meta = _wrapped(name, _built(name, "meta"))
    inputs, _ = _batch(name)
    sample = tuple(x[: B // M] for x in inputs)  # one micro-batch
    one = sample if len(sample) > 1 else sample[0]
    found = profile(meta, one, device="cpu", init_fn=hf_init(meta), warmup=0, repeat=1)
    return partition(meta, 2, one, n_microbatches=M, profile=found, cost="flops")  # flops: stable cuts


def _load_and_step(names: tuple[str, ...], folders: tuple[str, ...], plans: tuple[str, ...]) -> list[Any]:
    """Per model: (this rank's parameters and buffers as loaded, the step's loss, its gradients)."""
    from pipeline.runtime.pipe import Pipeline

    out = []
    for name, folder, plan in zip(names, folders, plans, strict=True):
        model = _wrapped(name, _built(name, "meta"))
        pipe = Pipeline(model, Plan.from_json(plan), loss_fn=_loss, init_fn=hf_init(model, pretrained=True))
        pipe.load_pretrained(folder)
        state = {k: t.detach().clone() for k, t in [*pipe.named_parameters(), *pipe.named_buffers()]}
        inputs, targets = _batch(name)
        loss = pipe.step(inputs if len(inputs) > 1 else inputs[0], targets)
        grads = {k: p.grad.clone() for k, p in pipe.named_parameters() if p.grad is not None}
        out.append((state, loss, grads))
        pipe.close()
    return out


_NAMES = ("gemma2", "bart")
_LOADED = job(
    2, _load_and_step,
    make_args=lambda f: (_NAMES, tuple(_save(n, f.mktemp(n)) for n in _NAMES),
                         tuple(_plan(n).to_json() for n in _NAMES)),
    timeout=240.0, batch="hf-load",
)  # fmt: skip


def _reference(name: str, folder: str) -> tuple[nn.Module, float, dict[str, torch.Tensor]]:
    """The model as from_pretrained loads it whole, and one process's step: the mean loss of the
    micro-batches, each one's gradient divided by their count (as the pipeline)."""
    auto = tf.AutoModelForSeq2SeqLM if name == "bart" else tf.AutoModelForCausalLM
    model = _wrapped(name, _quiet(lambda: auto.from_pretrained(folder)))
    model.train()
    inputs, targets = _batch(name)
    losses = []
    for rows in torch.arange(B).chunk(M):
        loss = _loss(model(*(x[rows] for x in inputs)), targets[rows])
        (loss / M).backward()
        losses.append(float(loss.detach()))
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return model, sum(losses) / M, grads


@pytest.mark.parametrize("name", _NAMES)
def test_load_pretrained_equals_from_pretrained_and_steps_as_one_process(
    name: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    results = _LOADED.results(tmp_path_factory)
    i = _NAMES.index(name)
    model, ref_loss, ref_grads = _reference(name, _LOADED.args[1][i])
    want = dict([*model.named_parameters(), *model.named_buffers()])
    loaded: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}
    for r, per_model in enumerate(results):
        state, loss, g = per_model[i]
        assert len(_plan(name).balance) == 2 and loss == pytest.approx(ref_loss, rel=1e-5), (name, r)
        assert_close(g, {k: ref_grads[k] for k in g}, f"{name} rank {r}")
        loaded.update({k: t for k, t in state.items() if not k.startswith("_constant")})  # trace constants
        grads.update(g)
    assert set(loaded) == set(want)  # every parameter and buffer, computed ones included
    for key, t in loaded.items():
        assert t.dtype == want[key].dtype and torch.equal(t, want[key]), (name, key)
    assert set(grads) == set(ref_grads)
