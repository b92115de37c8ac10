"""Hugging Face models as clients, built from a config (random init, no download), trained through
``@flash_inductor.train_step``: GPT-2 (``Conv1D`` projections: ``addmm`` on (in, out) weights, a
tied lm_head of a vocabulary that is not a multiple of 16) and Llama. Skipped without
``transformers`` (``pip install -e ".[clients]"``)."""

import time

import pytest
import torch

import flash_inductor
from flash_inductor.optimizer_record import prepared
from helpers import EAGER

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _train_step(model, **options):
    """A prepared AdamW and its ``train_step`` over ``model``, and one fixed batch of token ids."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)

    @flash_inductor.train_step(model=model, optimizer=opt, **EAGER, **options)
    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    ids = torch.randint(0, model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    return opt, step, ids


def _train(model, steps, **options):
    opt, step, ids = _train_step(model, **options)
    schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps)
    losses = []
    for _ in range(steps):
        losses.append(float(step(ids)))
        schedule.step()
    return opt, step, ids, losses


def _gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=64)
    return transformers.GPT2LMHeadModel(config)


def test_gpt2_trains_and_every_projection_runs_in_fp8():
    model = _gpt2()
    opt, step, ids, losses = _train(model, 4, fp8="tensorwise", fp8_min_weight_numel=0, fp8_output_layer=True)
    assert losses[-1] < losses[0]
    report = flash_inductor.inspect(step, ids)
    decisions = {subject: decision for g in report.graphs for _, subject, decision in g.decisions}
    projections = [n for n, _ in model.named_parameters() if n.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))]
    assert len(projections) == 8 and all(decisions[n] == "fp8 e4m3/e5m2" for n in projections)
    # the tied lm_head, in FP8 as asked (by default it is the output layer, kept bf16)
    assert decisions["transformer.wte.weight"] == "fp8 e4m3/e5m2, padded to 1008x64"
    assert flash_inductor.memory_report(model, opt).total_per_param < 7.25


def test_llama_trains_with_flat_buckets_and_its_rms_norms_and_rotary_frequencies_stay_fp32():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=1000, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    norms = {n: m.weight for n, m in model.named_modules() if type(m).__name__ == "LlamaRMSNorm"}
    assert len(norms) == 5 and not any(isinstance(m, torch.nn.RMSNorm) for m in model.modules())
    opt, _, _, losses = _train(model, 4)
    assert losses[-1] < losses[0]
    # the rotary embedding's frequencies stay fp32 (it computes its angles in fp32 and casts cos/sin)
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    record = prepared(opt)
    # LlamaRMSNorm is not an nn.RMSNorm: it stays fp32 (its own master) all the same, and trains.
    for name, weight in norms.items():
        assert weight.dtype == torch.float32 and record.error_term(weight) is None, name
        assert not torch.equal(weight, torch.ones_like(weight)), name
    assert all(p.dtype == torch.bfloat16 for n, p in model.named_parameters() if "norm" not in n)
    buckets = record.buckets
    assert sum(len(b.params) for b in buckets) == len(list(model.parameters()))


def test_inspect_of_the_gpt2_train_step_takes_under_30_s_and_names_its_graph_breaks():
    """Measured on the 2-core CPU: 10-12 s with the eager compiler (the passes, no kernels). With
    Inductor it takes ~75 s, of which ~62 s is the compile any first call of the step pays."""
    _, step, ids = _train_step(_gpt2())
    start = time.perf_counter()
    report = flash_inductor.inspect(step, ids)
    text = str(report)
    assert time.perf_counter() - start < 30
    model_graphs = [g for g in report.graphs if g.kind == "model"]
    assert model_graphs and report.graph("optimizer step")
    # Each piece the model's code was split into follows a graph break the report names, with its reason.
    assert len(report.graph_breaks) >= len(model_graphs) - 1
    assert all(b.reason and f"graph break at {b.location}: {b.headline}" in text for b in report.graph_breaks)


def test_regional_compiles_the_decoder_layers_of_gpt2_and_llama():
    """``train_step(..., regional=True)``'s blocks are the models' layers (their largest
    ``nn.ModuleList``), nothing else."""
    from flash_inductor.train_step import repeated_blocks

    gpt2 = _gpt2()
    assert repeated_blocks(gpt2) == list(gpt2.transformer.h)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=176, num_hidden_layers=3, num_attention_heads=4, vocab_size=1000))
    assert repeated_blocks(llama) == list(llama.model.layers)
