"""The rewritten Dynamo graphs of small optimizer steps, pinned as readable code.

Uses ``compiler="eager"``: the same torch-level passes as with Inductor, without compiling
kernels. Regenerate after an intended change with ``EXPECTTEST_ACCEPT=1 pytest tests/test_golden_graphs.py``.

Steps with ``add_(grad, alpha=...)`` have one expectation per torch version: Dynamo traces them
differently (``_compat.DYNAMO_SPLITS_NUMBER_ALPHA``). Regenerate each on its version (torch 2.11 and 2.13).
"""

import types

import expecttest
import torch
import torch.fx as fx
import torch.nn as nn

import flash_inductor
from flash_inductor import _compat
from flash_inductor.flat import BoundHyperparameter
from flash_inductor.optim import SGDW, Lion
from flash_inductor.passes.bound_hyperparameters import bound_hyperparameters_pass
from flash_inductor.pipeline import PassContext


def rewritten_code(make_optimizer, stage):
    return rewritten_stages(make_optimizer)[stage]


def rewritten_stages(make_optimizer):
    """{stage name: code} of the optimizer step's graph."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4, bias=False)
    opt = make_optimizer(model.parameters())
    flash_inductor.prepare(model, opt, min_quantized_numel=0, compile_options={"compiler": "eager"})
    model(torch.randn(2, 8, dtype=torch.bfloat16)).sum().backward()
    report = flash_inductor.inspect(flash_inductor.compile(opt.step, compiler="eager"))
    return {s.name: without_comments(s.code) for s in report.graph("optimizer step").stages}


def without_comments(code):
    # Comments carry source paths and line numbers of the installed torch; the code is what matters.
    return "\n".join(line.rstrip() for line in code.splitlines() if line.strip() and not line.strip().startswith("#"))


def fp8_linear_code(fn, options, *args):
    """The model graph of ``fn(*args)`` compiled with ``options``, as the ``fp8_linear`` pass left it."""
    report = flash_inductor.inspect(flash_inductor.compile(fn, **options), *args)
    return without_comments(next(s.code for s in report.graph("model").stages if s.name == "fp8_linear"))


class HeadProjections(nn.Module):
    """XLNet's attention projections: parameters of shape (hidden, heads, head dim) in einsums."""

    def __init__(self):
        super().__init__()
        self.q = nn.Parameter(torch.randn(32, 2, 16))
        self.o = nn.Parameter(torch.randn(32, 2, 16))

    def forward(self, x):
        heads = torch.einsum("ibh,hnd->ibnd", x, self.q)
        return torch.einsum("ibnd,hnd->ibh", heads.relu(), self.o)


class TestGoldenGraphs(expecttest.TestCase):
    def test_sgdw_momentum_step(self):
        code = rewritten_code(lambda ps: SGDW(ps, lr=0.1, momentum=0.9, weight_decay=0.01), "split_weights")
        if _compat.DYNAMO_SPLITS_NUMBER_ALPHA:  # the momentum's add_(grad, alpha=...)
            self.assertExpectedInline(code, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_optimizers_0_param_groups_0_lr_: "f32[]cpu", L_optimizers_0_param_groups_0_params_0_grad: "bf16[1, 32]cpu", L_optimizers_0_state_list_dict_keys_L_optimizers_0_state_0_momentum_buffer_: "CompandedState(bf16[1, 32]cpu)", group0_bfloat16_8bit_momentum: "f32[]cpu", active_groups_0: "b8[1, 1]cpu", group0_bfloat16_8bit_error: "i8[1, 32]cpu"):
        l_optimizers_0_param_groups_0_lr_ = L_optimizers_0_param_groups_0_lr_
        l_optimizers_0_param_groups_0_params_0_grad = L_optimizers_0_param_groups_0_params_0_grad
        l_optimizers_0_state_list_dict_keys_l_optimizers_0_state_0_momentum_buffer_ = L_optimizers_0_state_list_dict_keys_L_optimizers_0_state_0_momentum_buffer_
        _set_grad_enabled = torch._C._set_grad_enabled(False);  _set_grad_enabled = None
        p: "bf16[1, 32]cpu" = self.optimizers___0_param_groups_0__params___0
        mul: "f32[]cpu" = l_optimizers_0_param_groups_0_lr_ * 0.01
        sub: "f32[]cpu" = 1 - mul;  mul = None
        ne: "b8[]cpu" = torch.ne(l_optimizers_0_param_groups_0_lr_, 0)
        group0_bfloat16_8bit_moves: "b8[1, 1]cpu" = torch.logical_and(active_groups_0, ne);  ne = None
        group0_bfloat16_8bit_master: "f32[1, 32]cpu" = flash_inductor_formats_split_weights_decode_for_step(p, group0_bfloat16_8bit_error)
        group0_bfloat16_8bit_before: "f32[1, 32]cpu" = group0_bfloat16_8bit_master.clone()
        mul_: "f32[1, 32]cpu" = group0_bfloat16_8bit_master.mul_(sub);  sub = mul_ = None
        group0_bfloat16_8bit_momentum_buffer_fp32: "f32[1, 32]cpu" = flash_inductor_formats_state_tensor_decode(l_optimizers_0_state_list_dict_keys_l_optimizers_0_state_0_momentum_buffer_, shape = (1, 32))
        group0_bfloat16_8bit_momentum_buffer_before: "f32[1, 32]cpu" = group0_bfloat16_8bit_momentum_buffer_fp32.clone()
        mul__1: "f32[1, 32]cpu" = group0_bfloat16_8bit_momentum_buffer_fp32.mul_(group0_bfloat16_8bit_momentum);  group0_bfloat16_8bit_momentum = None
        group0_bfloat16_8bit_grad_fp32: "f32[1, 32]cpu" = flash_inductor_passes_companded_states_to_fp32(l_optimizers_0_param_groups_0_params_0_grad);  l_optimizers_0_param_groups_0_params_0_grad = None
        mul_1: "f32[1, 32]cpu" = torch.mul(group0_bfloat16_8bit_grad_fp32, 1.0);  group0_bfloat16_8bit_grad_fp32 = None
        add_: "f32[1, 32]cpu" = mul__1.add_(mul_1);  mul__1 = mul_1 = add_ = None
        mul_2: "f32[1, 32]cpu" = group0_bfloat16_8bit_momentum_buffer_fp32 * l_optimizers_0_param_groups_0_lr_;  l_optimizers_0_param_groups_0_lr_ = None
        where: "f32[1, 32]cpu" = torch.where(active_groups_0, group0_bfloat16_8bit_momentum_buffer_fp32, group0_bfloat16_8bit_momentum_buffer_before);  active_groups_0 = group0_bfloat16_8bit_momentum_buffer_before = None
        copy_: "f32[1, 32]cpu" = group0_bfloat16_8bit_momentum_buffer_fp32.copy_(where);  where = copy_ = None
        store = flash_inductor_formats_state_tensor_store(l_optimizers_0_state_list_dict_keys_l_optimizers_0_state_0_momentum_buffer_, group0_bfloat16_8bit_momentum_buffer_fp32);  l_optimizers_0_state_list_dict_keys_l_optimizers_0_state_0_momentum_buffer_ = group0_bfloat16_8bit_momentum_buffer_fp32 = store = None
        sub_: "f32[1, 32]cpu" = group0_bfloat16_8bit_master.sub_(mul_2);  mul_2 = sub_ = None
        where_1: "f32[1, 32]cpu" = torch.where(group0_bfloat16_8bit_moves, group0_bfloat16_8bit_master, group0_bfloat16_8bit_before);  group0_bfloat16_8bit_moves = group0_bfloat16_8bit_before = None
        copy__1: "f32[1, 32]cpu" = group0_bfloat16_8bit_master.copy_(where_1);  where_1 = copy__1 = None
        store_from_step = flash_inductor_formats_split_weights_store_from_step(p, group0_bfloat16_8bit_error, group0_bfloat16_8bit_master);  p = group0_bfloat16_8bit_error = group0_bfloat16_8bit_master = store_from_step = None
        _set_grad_enabled_1 = torch._C._set_grad_enabled(True);  _set_grad_enabled_1 = None
        return ()""")
        else:
            self.assertExpectedInline(code, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_optimizers_0_param_groups_0_lr_: "f32[]cpu", L_optimizers_0_param_groups_0_params_0_grad: "bf16[1, 32]cpu", L_optimizers_0_state_list_dict_keys_L_optimizers_0_state_0_momentum_buffer_: "CompandedState(bf16[1, 32]cpu)", group0_bfloat16_8bit_momentum: "f32[]cpu", active_groups_0: "b8[1, 1]cpu", group0_bfloat16_8bit_error: "i8[1, 32]cpu"):
        l_optimizers_0_param_groups_0_lr_ = L_optimizers_0_param_groups_0_lr_
        l_optimizers_0_param_groups_0_params_0_grad = L_optimizers_0_param_groups_0_params_0_grad
        l_optimizers_0_state_list_dict_keys_l_optimizers_0_state_0_momentum_buffer_ = L_optimizers_0_state_list_dict_keys_L_optimizers_0_state_0_momentum_buffer_
        _set_grad_enabled = torch._C._set_grad_enabled(False);  _set_grad_enabled = None
        p: "bf16[1, 32]cpu" = self.optimizers___0_param_groups_0__params___0
        mul: "f32[]cpu" = l_optimizers_0_param_groups_0_lr_ * 0.01
        sub: "f32[]cpu" = 1 - mul;  mul = None
        ne: "b8[]cpu" = torch.ne(l_optimizers_0_param_groups_0_lr_, 0)
        group0_bfloat16_8bit_moves: "b8[1, 1]cpu" = torch.logical_and(active_groups_0, ne);  ne = None
        group0_bfloat16_8bit_master: "f32[1, 32]cpu" = flash_inductor_formats_split_weights_decode_for_step(p, group0_bfloat16_8bit_error)
        group0_bfloat16_8bit_before: "f32[1, 32]cpu" = group0_bfloat16_8bit_master.clone()
        mul_: "f32[1, 32]cpu" = group0_bfloat16_8bit_master.mul_(sub);  sub = mul_ = None
        group0_bfloat16_8bit_momentum_buffer_fp32: "f32[1, 32]cpu" = flash_inductor_formats_state_tensor_decode(l_optimizers_0_state_list_dict_keys_l_optimizers_0_state_0_momentum_buffer_, shape = (1, 32))
        group0_bfloat16_8bit_momentum_buffer_before: "f32[1, 32]cpu" = group0_bfloat16_8bit_momentum_buffer_fp32.clone()
        mul__1: "f32[1, 32]cpu" = group0_bfloat16_8bit_momentum_buffer_fp32.mul_(group0_bfloat16_8bit_momentum);  group0_bfloat16_8bit_momentum = None
        group0_bfloat16_8bit_grad_fp32: "f32[1, 32]cpu" = flash_inductor_passes_companded_states_to_fp32(l_optimizers_0_param_groups_0_params_0_grad);  l_optimizers_0_param_groups_0_params_0_grad = None
        add_: "f32[1, 32]cpu" = mul__1.add_(group0_bfloat16_8bit_grad_fp32, alpha = 1.0);  mul__1 = group0_bfloat16_8bit_grad_fp32 = add_ = None
        mul_1: "f32[1, 32]cpu" = group0_bfloat16_8bit_momentum_buffer_fp32 * l_optimizers_0_param_groups_0_lr_;  l_optimizers_0_param_groups_0_lr_ = None
        where: "f32[1, 32]cpu" = torch.where(active_groups_0, group0_bfloat16_8bit_momentum_buffer_fp32, group0_bfloat16_8bit_momentum_buffer_before);  active_groups_0 = group0_bfloat16_8bit_momentum_buffer_before = None
        copy_: "f32[1, 32]cpu" = group0_bfloat16_8bit_momentum_buffer_fp32.copy_(where);  where = copy_ = None
        store = flash_inductor_formats_state_tensor_store(l_optimizers_0_state_list_dict_keys_l_optimizers_0_state_0_momentum_buffer_, group0_bfloat16_8bit_momentum_buffer_fp32);  l_optimizers_0_state_list_dict_keys_l_optimizers_0_state_0_momentum_buffer_ = group0_bfloat16_8bit_momentum_buffer_fp32 = store = None
        sub_: "f32[1, 32]cpu" = group0_bfloat16_8bit_master.sub_(mul_1);  mul_1 = sub_ = None
        where_1: "f32[1, 32]cpu" = torch.where(group0_bfloat16_8bit_moves, group0_bfloat16_8bit_master, group0_bfloat16_8bit_before);  group0_bfloat16_8bit_moves = group0_bfloat16_8bit_before = None
        copy__1: "f32[1, 32]cpu" = group0_bfloat16_8bit_master.copy_(where_1);  where_1 = copy__1 = None
        store_from_step = flash_inductor_formats_split_weights_store_from_step(p, group0_bfloat16_8bit_error, group0_bfloat16_8bit_master);  p = group0_bfloat16_8bit_error = group0_bfloat16_8bit_master = store_from_step = None
        _set_grad_enabled_1 = torch._C._set_grad_enabled(True);  _set_grad_enabled_1 = None
        return ()""")

    def test_lion_step(self):
        code = rewritten_code(lambda ps: Lion(ps, lr=1e-4, weight_decay=0.1), "split_weights")
        if _compat.DYNAMO_SPLITS_NUMBER_ALPHA:  # the update's add_(grad, alpha=1 - beta1)
            self.assertExpectedInline(code, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_optimizers_0_param_groups_0_lr_: "f32[]cpu", L_optimizers_0_param_groups_0_params_0_grad: "bf16[1, 32]cpu", L_optimizers_0_state_list_dict_keys_L_optimizers_0_state_0_exp_avg_: "CompandedState(bf16[1, 32]cpu)", active_groups_0: "b8[1, 1]cpu", group0_bfloat16_8bit_error: "i8[1, 32]cpu"):
        l_optimizers_0_param_groups_0_lr_ = L_optimizers_0_param_groups_0_lr_
        l_optimizers_0_param_groups_0_params_0_grad = L_optimizers_0_param_groups_0_params_0_grad
        l_optimizers_0_state_list_dict_keys_l_optimizers_0_state_0_exp_avg_ = L_optimizers_0_state_list_dict_keys_L_optimizers_0_state_0_exp_avg_
        _set_grad_enabled = torch._C._set_grad_enabled(False);  _set_grad_enabled = None
        p: "bf16[1, 32]cpu" = self.optimizers___0_param_groups_0__params___0
        mul: "f32[]cpu" = l_optimizers_0_param_groups_0_lr_ * 0.1
        sub: "f32[]cpu" = 1 - mul;  mul = None
        ne: "b8[]cpu" = torch.ne(l_optimizers_0_param_groups_0_lr_, 0)
        group0_bfloat16_8bit_moves: "b8[1, 1]cpu" = torch.logical_and(active_groups_0, ne);  ne = None
        group0_bfloat16_8bit_master: "f32[1, 32]cpu" = flash_inductor_formats_split_weights_decode_for_step(p, group0_bfloat16_8bit_error)
        group0_bfloat16_8bit_before: "f32[1, 32]cpu" = group0_bfloat16_8bit_master.clone()
        mul_: "f32[1, 32]cpu" = group0_bfloat16_8bit_master.mul_(sub);  sub = mul_ = None
        group0_bfloat16_8bit_exp_avg_fp32: "f32[1, 32]cpu" = flash_inductor_formats_state_tensor_decode(l_optimizers_0_state_list_dict_keys_l_optimizers_0_state_0_exp_avg_, shape = (1, 32))
        group0_bfloat16_8bit_exp_avg_before: "f32[1, 32]cpu" = group0_bfloat16_8bit_exp_avg_fp32.clone()
        mul_1: "f32[1, 32]cpu" = group0_bfloat16_8bit_exp_avg_fp32.mul(0.9)
        group0_bfloat16_8bit_grad_fp32: "f32[1, 32]cpu" = flash_inductor_passes_companded_states_to_fp32(l_optimizers_0_param_groups_0_params_0_grad);  l_optimizers_0_param_groups_0_params_0_grad = None
        mul_2: "f32[1, 32]cpu" = torch.mul(group0_bfloat16_8bit_grad_fp32, 0.09999999999999998)
        add_: "f32[1, 32]cpu" = mul_1.add_(mul_2);  mul_1 = mul_2 = None
        update: "f32[1, 32]cpu" = add_.sign_();  add_ = None
        mul_3: "f32[1, 32]cpu" = update * l_optimizers_0_param_groups_0_lr_;  update = l_optimizers_0_param_groups_0_lr_ = None
        sub_: "f32[1, 32]cpu" = group0_bfloat16_8bit_master.sub_(mul_3);  mul_3 = sub_ = None
        where_1: "f32[1, 32]cpu" = torch.where(group0_bfloat16_8bit_moves, group0_bfloat16_8bit_master, group0_bfloat16_8bit_before);  group0_bfloat16_8bit_moves = group0_bfloat16_8bit_before = None
        copy__1: "f32[1, 32]cpu" = group0_bfloat16_8bit_master.copy_(where_1);  where_1 = copy__1 = None
        store_from_step = flash_inductor_formats_split_weights_store_from_step(p, group0_bfloat16_8bit_error, group0_bfloat16_8bit_master);  p = group0_bfloat16_8bit_error = group0_bfloat16_8bit_master = store_from_step = None
        lerp_: "f32[1, 32]cpu" = group0_bfloat16_8bit_exp_avg_fp32.lerp_(group0_bfloat16_8bit_grad_fp32, 0.010000000000000009);  group0_bfloat16_8bit_grad_fp32 = lerp_ = None
        where: "f32[1, 32]cpu" = torch.where(active_groups_0, group0_bfloat16_8bit_exp_avg_fp32, group0_bfloat16_8bit_exp_avg_before);  active_groups_0 = group0_bfloat16_8bit_exp_avg_before = None
        copy_: "f32[1, 32]cpu" = group0_bfloat16_8bit_exp_avg_fp32.copy_(where);  where = copy_ = None
        store = flash_inductor_formats_state_tensor_store(l_optimizers_0_state_list_dict_keys_l_optimizers_0_state_0_exp_avg_, group0_bfloat16_8bit_exp_avg_fp32);  l_optimizers_0_state_list_dict_keys_l_optimizers_0_state_0_exp_avg_ = group0_bfloat16_8bit_exp_avg_fp32 = store = None
        _set_grad_enabled_1 = torch._C._set_grad_enabled(True);  _set_grad_enabled_1 = None
        return ()""")
        else:
            self.assertExpectedInline(code, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_optimizers_0_param_groups_0_lr_: "f32[]cpu", L_optimizers_0_param_groups_0_params_0_grad: "bf16[1, 32]cpu", L_optimizers_0_state_list_dict_keys_L_optimizers_0_state_0_exp_avg_: "CompandedState(bf16[1, 32]cpu)", active_groups_0: "b8[1, 1]cpu", group0_bfloat16_8bit_error: "i8[1, 32]cpu"):
        l_optimizers_0_param_groups_0_lr_ = L_optimizers_0_param_groups_0_lr_
        l_optimizers_0_param_groups_0_params_0_grad = L_optimizers_0_param_groups_0_params_0_grad
        l_optimizers_0_state_list_dict_keys_l_optimizers_0_state_0_exp_avg_ = L_optimizers_0_state_list_dict_keys_L_optimizers_0_state_0_exp_avg_
        _set_grad_enabled = torch._C._set_grad_enabled(False);  _set_grad_enabled = None
        p: "bf16[1, 32]cpu" = self.optimizers___0_param_groups_0__params___0
        mul: "f32[]cpu" = l_optimizers_0_param_groups_0_lr_ * 0.1
        sub: "f32[]cpu" = 1 - mul;  mul = None
        ne: "b8[]cpu" = torch.ne(l_optimizers_0_param_groups_0_lr_, 0)
        group0_bfloat16_8bit_moves: "b8[1, 1]cpu" = torch.logical_and(active_groups_0, ne);  ne = None
        group0_bfloat16_8bit_master: "f32[1, 32]cpu" = flash_inductor_formats_split_weights_decode_for_step(p, group0_bfloat16_8bit_error)
        group0_bfloat16_8bit_before: "f32[1, 32]cpu" = group0_bfloat16_8bit_master.clone()
        mul_: "f32[1, 32]cpu" = group0_bfloat16_8bit_master.mul_(sub);  sub = mul_ = None
        group0_bfloat16_8bit_exp_avg_fp32: "f32[1, 32]cpu" = flash_inductor_formats_state_tensor_decode(l_optimizers_0_state_list_dict_keys_l_optimizers_0_state_0_exp_avg_, shape = (1, 32))
        group0_bfloat16_8bit_exp_avg_before: "f32[1, 32]cpu" = group0_bfloat16_8bit_exp_avg_fp32.clone()
        mul_1: "f32[1, 32]cpu" = group0_bfloat16_8bit_exp_avg_fp32.mul(0.9)
        group0_bfloat16_8bit_grad_fp32: "f32[1, 32]cpu" = flash_inductor_passes_companded_states_to_fp32(l_optimizers_0_param_groups_0_params_0_grad);  l_optimizers_0_param_groups_0_params_0_grad = None
        add_: "f32[1, 32]cpu" = mul_1.add_(group0_bfloat16_8bit_grad_fp32, alpha = 0.09999999999999998);  mul_1 = None
        update: "f32[1, 32]cpu" = add_.sign_();  add_ = None
        mul_2: "f32[1, 32]cpu" = update * l_optimizers_0_param_groups_0_lr_;  update = l_optimizers_0_param_groups_0_lr_ = None
        sub_: "f32[1, 32]cpu" = group0_bfloat16_8bit_master.sub_(mul_2);  mul_2 = sub_ = None
        where_1: "f32[1, 32]cpu" = torch.where(group0_bfloat16_8bit_moves, group0_bfloat16_8bit_master, group0_bfloat16_8bit_before);  group0_bfloat16_8bit_moves = group0_bfloat16_8bit_before = None
        copy__1: "f32[1, 32]cpu" = group0_bfloat16_8bit_master.copy_(where_1);  where_1 = copy__1 = None
        store_from_step = flash_inductor_formats_split_weights_store_from_step(p, group0_bfloat16_8bit_error, group0_bfloat16_8bit_master);  p = group0_bfloat16_8bit_error = group0_bfloat16_8bit_master = store_from_step = None
        lerp_: "f32[1, 32]cpu" = group0_bfloat16_8bit_exp_avg_fp32.lerp_(group0_bfloat16_8bit_grad_fp32, 0.010000000000000009);  group0_bfloat16_8bit_grad_fp32 = lerp_ = None
        where: "f32[1, 32]cpu" = torch.where(active_groups_0, group0_bfloat16_8bit_exp_avg_fp32, group0_bfloat16_8bit_exp_avg_before);  active_groups_0 = group0_bfloat16_8bit_exp_avg_before = None
        copy_: "f32[1, 32]cpu" = group0_bfloat16_8bit_exp_avg_fp32.copy_(where);  where = copy_ = None
        store = flash_inductor_formats_state_tensor_store(l_optimizers_0_state_list_dict_keys_l_optimizers_0_state_0_exp_avg_, group0_bfloat16_8bit_exp_avg_fp32);  l_optimizers_0_state_list_dict_keys_l_optimizers_0_state_0_exp_avg_ = group0_bfloat16_8bit_exp_avg_fp32 = store = None
        _set_grad_enabled_1 = torch._C._set_grad_enabled(True);  _set_grad_enabled_1 = None
        return ()""")

    def test_adamw_bias_corrections_take_step_powers_in_fp64(self):
        """``beta ** step`` of AdamW's bias corrections, of the float betas rounded to fp32, in fp64.
        Only those lines: the rest of the stock AdamW graph differs between torch versions."""
        stages = rewritten_stages(lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01))
        powers = {stage: "\n".join(line for line in stages[stage].splitlines() if "pow" in line)
                  for stage in ("captured", "fp64_step_powers")}
        self.assertExpectedInline(powers["captured"], """\
        pow_1: "f32[1, 1]cpu" = 0.9 ** step_t_1
        bias_correction1: "f32[1, 1]cpu" = 1 - pow_1;  pow_1 = None
        pow_2: "f32[1, 1]cpu" = 0.999 ** step_t_1;  step_t_1 = None
        bias_correction2: "f32[1, 1]cpu" = 1 - pow_2;  pow_2 = None""")
        self.assertExpectedInline(powers["fp64_step_powers"], """\
        pow_1: "f32[1, 1]cpu" = flash_inductor_passes_fp64_step_powers_pow_in_fp64(0.8999999761581421, step_t_1)
        bias_correction1: "f32[1, 1]cpu" = 1 - pow_1;  pow_1 = None
        pow_2: "f32[1, 1]cpu" = flash_inductor_passes_fp64_step_powers_pow_in_fp64(0.9990000128746033, step_t_1);  step_t_1 = None
        bias_correction2: "f32[1, 1]cpu" = 1 - pow_2;  pow_2 = None""")

    def test_momentum_traced_as_nan_becomes_the_buckets_tensor(self):
        """SGDW's own update with Nesterov momentum: a factor (``mul_``) and an ``alpha``."""
        make = lambda ps: SGDW(ps, lr=0.1, momentum=0.9, nesterov=True)  # noqa: E731
        self.assertIn("momentum_buffer_.mul_(nan)", rewritten_code(make, "captured"))
        code = rewritten_code(make, "bound_hyperparameters")
        if _compat.DYNAMO_SPLITS_NUMBER_ALPHA:  # the momentum's add_(grad, alpha=...)
            self.assertExpectedInline(code, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_optimizers_0_param_groups_0_lr_: "f32[]cpu", L_optimizers_0_param_groups_0_params_0_grad: "bf16[1, 32]cpu", L_optimizers_0_state_list_dict_keys_L_optimizers_0_state_0_momentum_buffer_: "CompandedState(bf16[1, 32]cpu)", group0_bfloat16_8bit_momentum: "f32[]cpu"):
        l_optimizers_0_param_groups_0_lr_ = L_optimizers_0_param_groups_0_lr_
        l_optimizers_0_param_groups_0_params_0_grad = L_optimizers_0_param_groups_0_params_0_grad
        l_optimizers_0_state_list_dict_keys_l_optimizers_0_state_0_momentum_buffer_ = L_optimizers_0_state_list_dict_keys_L_optimizers_0_state_0_momentum_buffer_
        _set_grad_enabled = torch._C._set_grad_enabled(False);  _set_grad_enabled = None
        p: "bf16[1, 32]cpu" = self.optimizers___0_param_groups_0__params___0
        mul: "f32[]cpu" = l_optimizers_0_param_groups_0_lr_ * 0.0
        sub: "f32[]cpu" = 1 - mul;  mul = None
        mul_: "bf16[1, 32]cpu" = p.mul_(sub);  sub = mul_ = None
        mul__1: "CompandedState(bf16[1, 32]cpu)" = l_optimizers_0_state_list_dict_keys_l_optimizers_0_state_0_momentum_buffer_.mul_(group0_bfloat16_8bit_momentum)
        mul_1: "bf16[1, 32]cpu" = torch.mul(l_optimizers_0_param_groups_0_params_0_grad, 1.0)
        add_: "CompandedState(bf16[1, 32]cpu)" = mul__1.add_(mul_1);  mul__1 = mul_1 = add_ = None
        mul_3: "bf16[1, 32]cpu" = l_optimizers_0_state_list_dict_keys_l_optimizers_0_state_0_momentum_buffer_ * group0_bfloat16_8bit_momentum;  l_optimizers_0_state_list_dict_keys_l_optimizers_0_state_0_momentum_buffer_ = group0_bfloat16_8bit_momentum = None
        direction: "bf16[1, 32]cpu" = l_optimizers_0_param_groups_0_params_0_grad.add(mul_3);  l_optimizers_0_param_groups_0_params_0_grad = mul_3 = None
        mul_2: "bf16[1, 32]cpu" = direction * l_optimizers_0_param_groups_0_lr_;  direction = l_optimizers_0_param_groups_0_lr_ = None
        sub_: "bf16[1, 32]cpu" = p.sub_(mul_2);  p = mul_2 = sub_ = None
        _set_grad_enabled_1 = torch._C._set_grad_enabled(True);  _set_grad_enabled_1 = None
        return ()""")
        else:
            self.assertExpectedInline(code, """\
class GraphModule(torch.nn.Module):
    def forward(self, L_optimizers_0_param_groups_0_lr_: "f32[]cpu", L_optimizers_0_param_groups_0_params_0_grad: "bf16[1, 32]cpu", L_optimizers_0_state_list_dict_keys_L_optimizers_0_state_0_momentum_buffer_: "CompandedState(bf16[1, 32]cpu)", group0_bfloat16_8bit_momentum: "f32[]cpu"):
        l_optimizers_0_param_groups_0_lr_ = L_optimizers_0_param_groups_0_lr_
        l_optimizers_0_param_groups_0_params_0_grad = L_optimizers_0_param_groups_0_params_0_grad
        l_optimizers_0_state_list_dict_keys_l_optimizers_0_state_0_momentum_buffer_ = L_optimizers_0_state_list_dict_keys_L_optimizers_0_state_0_momentum_buffer_
        _set_grad_enabled = torch._C._set_grad_enabled(False);  _set_grad_enabled = None
        p: "bf16[1, 32]cpu" = self.optimizers___0_param_groups_0__params___0
        mul: "f32[]cpu" = l_optimizers_0_param_groups_0_lr_ * 0.0
        sub: "f32[]cpu" = 1 - mul;  mul = None
        mul_: "bf16[1, 32]cpu" = p.mul_(sub);  sub = mul_ = None
        mul__1: "CompandedState(bf16[1, 32]cpu)" = l_optimizers_0_state_list_dict_keys_l_optimizers_0_state_0_momentum_buffer_.mul_(group0_bfloat16_8bit_momentum)
        add_: "CompandedState(bf16[1, 32]cpu)" = mul__1.add_(l_optimizers_0_param_groups_0_params_0_grad, alpha = 1.0);  mul__1 = add_ = None
        mul_2: "bf16[1, 32]cpu" = l_optimizers_0_state_list_dict_keys_l_optimizers_0_state_0_momentum_buffer_ * group0_bfloat16_8bit_momentum;  l_optimizers_0_state_list_dict_keys_l_optimizers_0_state_0_momentum_buffer_ = group0_bfloat16_8bit_momentum = None
        direction: "bf16[1, 32]cpu" = l_optimizers_0_param_groups_0_params_0_grad.add(mul_2);  l_optimizers_0_param_groups_0_params_0_grad = mul_2 = None
        mul_1: "bf16[1, 32]cpu" = direction * l_optimizers_0_param_groups_0_lr_;  direction = l_optimizers_0_param_groups_0_lr_ = None
        sub_: "bf16[1, 32]cpu" = p.sub_(mul_1);  p = mul_1 = sub_ = None
        _set_grad_enabled_1 = torch._C._set_grad_enabled(True);  _set_grad_enabled_1 = None
        return ()""")

    def test_a_nan_computed_from_a_bound_hyperparameter_is_refused(self):
        """Only the traced NaN object itself can be bound; ``1 - momentum`` (a NaN too) cannot."""
        bound = BoundHyperparameter("momentum", torch.tensor(0.9))
        graph = fx.Graph()
        x = graph.placeholder("x")
        graph.call_method("mul_", (x, bound.traced_as))
        graph.output(graph.call_method("mul", (x, 1 - bound.traced_as)))
        record = types.SimpleNamespace(bound_hyperparameter=bound, param_names={x: "group0"})
        ctx = PassContext(roles={"x": types.SimpleNamespace(prepared=record)}, written={"x"}, options=None)
        with self.assertRaisesRegex(ValueError, "computed from one"):
            bound_hyperparameters_pass(fx.GraphModule({}, graph), ctx)

    def test_captured_graph_is_the_stock_step(self):
        captured = rewritten_code(lambda ps: SGDW(ps, lr=0.1, momentum=0.9), "captured")
        self.assertNotIn("decode", captured)
        self.assertIn("p.sub_", captured)

    def test_fp8_linear_with_delayed_scaling(self):
        """The layer's delayed-scaling buffers become inputs of the forward graph."""
        options = {"compiler": "eager", "fp8": "delayed", "fp8_min_weight_numel": 0, "fp8_history_length": 4}
        self.assertExpectedInline(fp8_linear_code(nn.Linear(32, 16, bias=False), options, torch.randn(4, 32)), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_fn_parameters_weight_: "f32[16, 32]cpu", L_args_0_: "f32[4, 32]cpu", weight_fp8_amax_history: "f32[2, 4]cpu", weight_fp8_scale: "f32[2]cpu", weight_fp8_grad_amax_history: "f32[1, 4]cpu", weight_fp8_grad_scale: "f32[1]cpu"):
        l_fn_parameters_weight_ = L_fn_parameters_weight_
        l_args_0_ = L_args_0_
        fp8_linear: "f32[4, 16]cpu" = flash_inductor_fp8_linear_fp8_linear(l_args_0_, l_fn_parameters_weight_, None, power_of_two = False, amax_history = weight_fp8_amax_history, scale = weight_fp8_scale, grad_amax_history = weight_fp8_grad_amax_history, grad_scale = weight_fp8_grad_scale);  l_args_0_ = l_fn_parameters_weight_ = weight_fp8_amax_history = weight_fp8_scale = weight_fp8_grad_amax_history = weight_fp8_grad_scale = None
        return (fp8_linear,)""")

    def test_fp8_linear_with_rowwise_scales(self):
        """``fp8="rowwise"``: the call says so, and takes no per-tensor scaling options."""
        options = {"compiler": "eager", "fp8": "rowwise", "fp8_min_weight_numel": 0}
        self.assertExpectedInline(fp8_linear_code(nn.Linear(32, 16), options, torch.randn(4, 32)), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_fn_parameters_weight_: "f32[16, 32]cpu", L_fn_parameters_bias_: "f32[16]cpu", L_args_0_: "f32[4, 32]cpu"):
        l_fn_parameters_weight_ = L_fn_parameters_weight_
        l_fn_parameters_bias_ = L_fn_parameters_bias_
        l_args_0_ = L_args_0_
        fp8_linear: "f32[4, 16]cpu" = flash_inductor_fp8_linear_fp8_linear(l_args_0_, l_fn_parameters_weight_, l_fn_parameters_bias_, rowwise = True);  l_args_0_ = l_fn_parameters_weight_ = l_fn_parameters_bias_ = None
        return (fp8_linear,)""")

    def test_fp8_linear_on_a_weight_norm_parametrization(self):
        """The weight ``weight_norm`` computes from its two parameters is the FP8 linear's weight."""
        options = {"compiler": "eager", "fp8": "tensorwise", "fp8_min_weight_numel": 0}
        layer = nn.utils.parametrizations.weight_norm(nn.Linear(32, 16, bias=False))
        self.assertExpectedInline(fp8_linear_code(layer, options, torch.randn(4, 32)), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_fn_modules_parametrizations_modules_weight_parameters_original0_: "f32[16, 1]cpu", L_fn_modules_parametrizations_modules_weight_parameters_original1_: "f32[16, 32]cpu", L_args_0_: "f32[4, 32]cpu"):
        l_fn_modules_parametrizations_modules_weight_parameters_original0_ = L_fn_modules_parametrizations_modules_weight_parameters_original0_
        l_fn_modules_parametrizations_modules_weight_parameters_original1_ = L_fn_modules_parametrizations_modules_weight_parameters_original1_
        l_args_0_ = L_args_0_
        x: "f32[16, 32]cpu" = torch._weight_norm(l_fn_modules_parametrizations_modules_weight_parameters_original1_, l_fn_modules_parametrizations_modules_weight_parameters_original0_, 0);  l_fn_modules_parametrizations_modules_weight_parameters_original1_ = l_fn_modules_parametrizations_modules_weight_parameters_original0_ = None
        fp8_linear: "f32[4, 16]cpu" = flash_inductor_fp8_linear_fp8_linear(l_args_0_, x, None, power_of_two = False);  l_args_0_ = x = None
        return (fp8_linear,)""")

    def test_fp8_linear_on_einsums_with_a_rank_3_parameter(self):
        """XLNet's projections: einsums with a parameter of shape (hidden, heads, head dim), contracted
        over hidden (``x @ q``) or over heads and head dim (``x @ o.T``), run as FP8 linears on the
        parameter reshaped to 2-D."""
        options = {"compiler": "eager", "fp8": "tensorwise", "fp8_min_weight_numel": 0}
        self.assertExpectedInline(fp8_linear_code(HeadProjections(), options, torch.randn(8, 2, 32)), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_self_parameters_q_: "f32[32, 2, 16]cpu", L_x_: "f32[8, 2, 32]cpu", L_self_parameters_o_: "f32[32, 2, 16]cpu"):
        l_self_parameters_q_ = L_self_parameters_q_
        l_x_ = L_x_
        l_self_parameters_o_ = L_self_parameters_o_
        reshape: "f32[32, 32]cpu" = l_self_parameters_q_.reshape(32, 32);  l_self_parameters_q_ = None
        t: "f32[32, 32]cpu" = reshape.t();  reshape = None
        fp8_linear: "f32[8, 2, 32]cpu" = flash_inductor_fp8_linear_fp8_linear(l_x_, t, None, power_of_two = False);  l_x_ = t = None
        unflatten: "f32[8, 2, 2, 16]cpu" = fp8_linear.unflatten(-1, (2, 16));  fp8_linear = None
        relu: "f32[8, 2, 2, 16]cpu" = unflatten.relu();  unflatten = None
        flatten: "f32[8, 2, 32]cpu" = relu.flatten(-2);  relu = None
        reshape_1: "f32[32, 32]cpu" = l_self_parameters_o_.reshape(32, 32);  l_self_parameters_o_ = None
        fp8_linear_1: "f32[8, 2, 32]cpu" = flash_inductor_fp8_linear_fp8_linear(flatten, reshape_1, None, power_of_two = False);  flatten = reshape_1 = None
        return (fp8_linear_1,)""")

    def test_fp8_multi_head_attention(self):
        """``nn.MultiheadAttention``'s call, one node with the weights as operands, becomes
        ``fp8_multi_head_attention_forward`` with the same arguments, naming the weights in FP8."""
        options = {"compiler": "eager", "fp8": "tensorwise", "fp8_min_weight_numel": 0}
        layer = nn.MultiheadAttention(32, 2, bias=False)
        x = torch.randn(4, 1, 32)
        self.assertExpectedInline(fp8_linear_code(lambda t: layer(t, t, t, need_weights=False)[0], options, x), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_t_: "f32[4, 1, 32]cpu", L_layer_parameters_in_proj_weight_: "f32[96, 32]cpu", L_layer_modules_out_proj_parameters_weight_: "f32[32, 32]cpu"):
        l_t_ = L_t_
        l_layer_parameters_in_proj_weight_ = L_layer_parameters_in_proj_weight_
        l_layer_modules_out_proj_parameters_weight_ = L_layer_modules_out_proj_parameters_weight_
        fp8_multi_head_attention_forward = flash_inductor_multi_head_attention_fp8_multi_head_attention_forward(l_t_, l_t_, l_t_, 32, 2, l_layer_parameters_in_proj_weight_, None, None, None, False, 0.0, l_layer_modules_out_proj_parameters_weight_, None, training = True, key_padding_mask = None, need_weights = False, attn_mask = None, average_attn_weights = True, is_causal = False, fp8_weights = ('in_proj_weight', 'out_proj_weight'), fp8_options = {'power_of_two': False});  l_t_ = l_layer_parameters_in_proj_weight_ = l_layer_modules_out_proj_parameters_weight_ = None
        attn_output: "f32[4, 1, 32]cpu" = fp8_multi_head_attention_forward[0];  fp8_multi_head_attention_forward = None
        return (attn_output,)""")

    def test_fp8_linear_in_an_activation_checkpointed_region(self):
        """A linear inside ``torch.utils.checkpoint`` is rewritten in the region's body, its weight being
        an operand of the region."""

        class Checkpointed(nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = nn.Linear(32, 16, bias=False)

            def forward(self, x):
                return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)

        options = {"compiler": "eager", "fp8": "tensorwise", "fp8_min_weight_numel": 0}
        self.assertExpectedInline(fp8_linear_code(Checkpointed(), options, torch.randn(4, 32)), """\
class GraphModule(torch.nn.Module):
    def forward(self, L_x_: "f32[4, 32]cpu", L_self_modules_inner_parameters_weight_: "f32[16, 32]cpu"):
        l_x_ = L_x_
        l_self_modules_inner_parameters_weight_ = L_self_modules_inner_parameters_weight_
        wrap_body_0 = self.wrap_body_0
        tag_activation_checkpoint = torch.ops.higher_order.tag_activation_checkpoint(wrap_body_0, l_x_, l_self_modules_inner_parameters_weight_, use_reentrant = False);  wrap_body_0 = l_x_ = l_self_modules_inner_parameters_weight_ = None
        getitem: "f32[4, 16]cpu" = tag_activation_checkpoint[0];  tag_activation_checkpoint = None
        return (getitem,)
    class wrap_body_0(torch.nn.Module):
        def forward(self, l_x_: "f32[4, 32]cpu", l_self_modules_inner_parameters_weight_: "f32[16, 32]cpu"):
            fp8_linear = flash_inductor_fp8_linear_fp8_linear(l_x_, l_self_modules_inner_parameters_weight_, None, power_of_two = False);  l_x_ = l_self_modules_inner_parameters_weight_ = None
            return (fp8_linear,)""")

