"""Hugging Face architectures we did not write, through ``benchmarks/hf_zoo.py`` on the CPU (tiny
configs; ``compiler="eager"``, the passes without kernels, except Phi, Granite MoE and the Llama's
row-wise FP8 step, which run Inductor's C++ code). Each one here once failed in its own way:
Falcon writes a linear's output in place (``mlp_output += attention_output``: the FP8 pass was
skipped), Bloom's GELU is an ``autograd.Function`` (its body, a GraphModule attribute, broke fake
propagation, so the step failed to compile), and Mixtral's experts are grouped matmuls on 3-D
parameters (missing from the report). ResNet and Whisper take fp32 inputs (pixel values, mel
features) into convolutions whose weights ``prepare`` made bf16: they failed torch's dtype check;
ResNet's BatchNorm2d layers stay fp32. FNet mixes its tokens with ``torch.fft.fftn``, which has no bf16
kernel: its mixing modules, without parameters, are kept fp32 by name (``keep_fp32``, which gave them
no fp32 casts before). Skipped without ``transformers``."""

import math

import pytest

from helpers import benchmark_module

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("fresh_dynamo")

OUTPUT_LAYER = {"bf16: the output layer: the loss reads its output (fp8_output_layer=True puts it in FP8)": 1}
CONVOLUTION = "bf16: convolution: torch has no FP8 convolution"
# FP8 linears of each tiny model, what stays bf16 (with its reason) and how often, and the most bytes
# per parameter memory_report may give (a tiny ResNet's tensors are mostly under min_quantized_numel:
# fp32 states)
EXPECTED = {
    "falcon": (8, OUTPUT_LAYER, 7.5),
    "bloom": (8, OUTPUT_LAYER, 7.5),
    "mixtral": (8, {
        "bf16: weight 4x64: FP8 GEMMs need both dims to be multiples of 16 (padding would add over 1%)": 2,  # routers
        **OUTPUT_LAYER,
        "bf16: grouped matmul (a mixture of experts' weights): FP8 grouped GEMMs are not supported": 4,
    }, 7.5),
    "resnet": (0, {
        "bf16: weight 10x64: FP8 GEMMs need both dims to be multiples of 16 (padding would add over 1%)": 1,  # classifier
        CONVOLUTION: 9,
    }, 14),
    "whisper": (32, {**OUTPUT_LAYER, CONVOLUTION: 2}, 7.5),
    "fnet": (7, OUTPUT_LAYER, 7.5),
}


@pytest.fixture(scope="module")
def zoo():
    bench = benchmark_module("hf_zoo")
    args = ["--device", "cpu", "--size", "tiny", "--compiler", "eager", "--steps", "3", "--models", ",".join(EXPECTED)]
    return bench.main(args)


@pytest.mark.parametrize("name", EXPECTED)
def test_each_architecture_trains_like_the_stock_step_with_its_linears_in_fp8(zoo, name):
    rows = zoo[name]
    assert all(r["ok"] for r in rows.values()), {row: r.get("error") for row, r in rows.items()}
    stock = rows["stock"]["losses"]
    assert stock[-1] < stock[0]
    for row in ("flashoptim", "flashoptim_fp8"):
        r = rows[row]
        assert r["pass_failed"] == [] and r["other_graph_breaks"] == [], row
        # bf16 weights (and FP8 GEMMs) against fp32 over three steps of lr 1e-3: well within 1%
        assert all(math.isclose(a, b, rel_tol=0.01) for a, b in zip(r["losses"], stock)), (row, r["losses"], stock)
        assert r["bytes_per_param"] < EXPECTED[name][2]
    fp8, bf16, _ = EXPECTED[name]
    assert (rows["flashoptim_fp8"]["fp8"], rows["flashoptim_fp8"]["bf16"]) == (fp8, bf16)
    assert rows["flashoptim"]["fp8"] == 0


def test_phi_compiles_with_inductors_cpu_code_where_the_vectorizer_fails():
    """Phi through Inductor's C++ code (not ``compiler="eager"``): on torch 2.13 a graph of its step
    is vectorized into C++ that does not compile, as under stock ``torch.compile`` (GPT-NeoX's too);
    ``_compat.compile_without_cpp_vectorizer_on_its_known_error`` compiles that graph again without
    vectorization, from a copy taken before the first compile's passes rewrote it (on the rewritten
    graph the retry failed: ``KeyError: slice_scatter_default_20``). It trains as the stock step does."""
    bench = benchmark_module("hf_zoo")
    rows = bench.main(["--device", "cpu", "--size", "tiny", "--steps", "3", "--models", "phi",
                       "--rows", "stock,flashoptim"])["phi"]
    assert all(r["ok"] for r in rows.values()), {row: r.get("error") for row, r in rows.items()}
    stock, ours = rows["stock"]["losses"], rows["flashoptim"]["losses"]
    assert ours[-1] < ours[0] and all(math.isclose(a, b, rel_tol=0.01) for a, b in zip(ours, stock)), (ours, stock)


def test_granite_moe_trains_in_fp8_through_inductors_cpu_code():
    """Granite MoE's FP8 backward reads its attention inputs transposed, which Inductor's C++ code
    does by 32 x 32 bf16 tiles. Where its 512-bit tile transposes are wrong (torch 2.13, g++ 12.2,
    AVX-512) the second loss was NaN: layer 0's q/k/v gradients were. The backend compiles with
    256-bit vectors there (flash_inductor/_compat.py)."""
    bench = benchmark_module("hf_zoo")
    rows = bench.main(["--device", "cpu", "--size", "tiny", "--steps", "3", "--models", "granitemoe",
                       "--rows", "stock,flashoptim_fp8"])["granitemoe"]
    assert all(r["ok"] for r in rows.values()), {row: r.get("error") for row, r in rows.items()}
    stock, r = rows["stock"]["losses"], rows["flashoptim_fp8"]
    assert r["fp8"] == 8, (r["fp8"], r["bf16"])
    assert all(math.isclose(a, b, rel_tol=0.01) for a, b in zip(r["losses"], stock)), (r["losses"], stock)


def test_llama_trains_in_rowwise_fp8_through_inductors_cpu_code():
    """A Llama's row-wise FP8 step through Inductor's C++ code: each row's power-of-two scale is bit
    operations that Inductor vectorizes. A leaner form of that rounding (without the subnormal lift)
    passed the one-linear tests but gave NaN gradients here from the first step (torch 2.13's
    vectorized C++; eager and ``cpp.simdlen=1`` were right), so a whole model guards it. (Tensorwise
    scales are one scalar per tensor, outside the vectorized loops.)"""
    bench = benchmark_module("hf_zoo")
    rows = bench.main(["--device", "cpu", "--size", "tiny", "--steps", "3", "--models", "llama",
                       "--rows", "stock,flashoptim_fp8+rowwise"])["llama"]
    assert all(r["ok"] for r in rows.values()), {row: r.get("error") for row, r in rows.items()}
    stock, r = rows["stock"]["losses"], rows["flashoptim_fp8+rowwise"]
    assert r["fp8"] == 14 and r["pass_failed"] == [], (r["fp8"], r["bf16"], r["pass_failed"])
    assert all(math.isclose(a, b, rel_tol=0.01) for a, b in zip(r["losses"], stock)), (r["losses"], stock)


def test_lora_adapters_on_a_frozen_llama_train_like_stock_with_the_base_in_fp8():
    """A LoRA fine-tune as users write one: every weight of a tiny Llama frozen, a low-rank adapter
    beside each attention projection, the optimizer over the adapters alone. Through ``train_step``
    with FP8 the frozen projections multiply in FP8 (no weight gradient), their bf16 bits never
    change and hold no optimizer state, and the losses follow stock fp32 AdamW's."""
    import torch
    import torch.nn as nn

    import flash_inductor
    from flash_inductor import inspection

    bench = benchmark_module("hf_zoo")

    class LoRALinear(nn.Module):
        def __init__(self, base, rank=16):
            super().__init__()
            self.base = base
            self.lora_a = nn.Linear(base.in_features, rank, bias=False)
            self.lora_b = nn.Linear(rank, base.out_features, bias=False)
            nn.init.normal_(self.lora_b.weight, std=0.02)

        def forward(self, x):
            return self.base(x) + 2.0 * self.lora_b(self.lora_a(x))

    def lora_llama():
        model = bench.build_model("llama", "tiny", torch.device("cpu"))
        model.requires_grad_(False)
        torch.manual_seed(5)
        for layer in model.model.layers:
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                setattr(layer.self_attn, name, LoRALinear(getattr(layer.self_attn, name)))
        return model

    batch = bench.fixed_batch("llama", "tiny", "cpu")
    losses = {}
    for row in ("stock", "fp8"):
        model = lora_llama()
        adapters = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(adapters, lr=1e-3)

        def step(batch, model=model, opt=opt):
            loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        if row == "fp8":
            step = flash_inductor.train_step(step, model=model, optimizer=opt, fp8="tensorwise", fp8_min_weight_numel=0,
                                             fp8_min_gemm_size=0, compiler="eager")
            frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
        report = inspection.Report()
        with inspection.collecting(report):
            losses[row] = [step(batch).item()]
        losses[row] += [step(batch).item() for _ in range(3)]
    decisions = {name: d for g in report.graphs for p, name, d in g.decisions if p == "fp8_linear"}
    base = [n for n in decisions if ".base." in n]
    assert len(base) == 8 and all(decisions[n].startswith("fp8") for n in base), decisions
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, frozen[n]) and p not in opt.state, n
            assert p.dtype == (torch.float32 if p.dim() == 1 else torch.bfloat16), (n, p.dtype)
    assert losses["fp8"][-1] < losses["fp8"][0]
    assert all(math.isclose(a, b, rel_tol=1e-3) for a, b in zip(losses["fp8"], losses["stock"])), losses
