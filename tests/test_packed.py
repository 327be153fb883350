"""``creditrl.runtime.packed``: linear layers with weights packed once for a sampling call give the
plain layers' products up to float32 rounding, and leave the model exactly as it was."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import prune

from creditrl.runtime.packed import PACK_MIN_ELEMENTS, can_pack, packed_linears
from tolerances import sum_rtol

pytestmark = pytest.mark.skipif(not can_pack(nn.Linear(2, 2)), reason="this torch build has no oneDNN packed linear")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = nn.Linear(24, 40), nn.Linear(40, 7, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def products_close(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, net: Net) -> None:
    """Each output of the two layers is a dot product over 24 then 40 terms: within that chain's
    rounding of the magnitudes it sums (|x| |W| propagated through both layers, and a bias each)."""
    bound = torch.relu(x.abs() @ net.up.weight.abs().t() + net.up.bias.abs()) @ net.down.weight.abs().t()
    terms = 24 + 40 + 2
    if net.down.bias is not None:
        bound, terms = bound + net.down.bias.abs(), terms + 1
    assert bool(((got - want).abs() <= sum_rtol(terms) * bound).all())


@pytest.mark.parametrize("shape", [(1, 24), (3, 24), (16, 24), (80, 24), (2, 5, 24), (16, 1, 24), (0, 24)])
@pytest.mark.parametrize("rows", [1, 16])
def test_packed_products_equal_the_plain_ones_up_to_rounding(shape, rows):
    net = Net()
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    want = net(x)
    with torch.inference_mode(), packed_linears(net, rows, min_elements=0) as packed:
        got = net(x)
        assert packed == 2
    assert got.shape == want.shape
    products_close(got, want, x, net)
    assert "forward" not in net.up.__dict__ and torch.equal(net(x), want)     # restored exactly


def test_weights_are_packed_on_entry_and_left_as_they_were():
    net, x = Net(), torch.randn(4, 24)
    with torch.no_grad():
        net.up.weight.mul_(-2.0)              # changed between two sampling calls, as an optimizer step does
    want = net(x)
    with torch.no_grad(), packed_linears(net, 4, min_elements=0):
        got = net(x)
    products_close(got, want, x, net)
    assert net.up.weight.requires_grad and isinstance(net.up.weight, nn.Parameter)


def test_what_is_not_packed():
    class MyLinear(nn.Linear):
        pass

    net = Net()
    net.up = MyLinear(24, 40)                          # a subclass: its own forward may differ
    net.down.forward = lambda x: x[..., :7] * 0        # a forward already replaced (an accelerate hook)
    with torch.no_grad(), packed_linears(net, 4, min_elements=0) as packed:
        assert packed == 0
    with torch.no_grad(), packed_linears(Net(), 4, enabled=False) as packed:
        assert packed == 0
    with torch.no_grad(), packed_linears(Net().double(), 4, min_elements=0) as packed:   # only float32 weights
        assert packed == 0
    assert not can_pack(nn.Module())                                     # no parameters at all


def test_only_layers_large_enough_to_earn_the_call_are_packed():
    """By default a weight of <= PACK_MIN_ELEMENTS elements keeps the plain product (oneDNN's call costs
    more than a small product saves): the built-in tiny model's layers (128 x 512 at most)."""
    net = Net()
    net.down = nn.Linear(40, PACK_MIN_ELEMENTS // 40 + 1)
    with torch.no_grad(), packed_linears(net, 4) as packed:
        assert packed == 1 and "forward" in net.down.__dict__ and "forward" not in net.up.__dict__


def test_autocast_takes_the_plain_path():
    """Under bf16 autocast the product is autocast's (bf16), bit for bit, not the packed float32 one:
    entered under autocast nothing is packed (the copies would go unused); autocast switched on inside
    a block runs the plain layers."""
    net, x = Net(), torch.randn(5, 24)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = net(x)
        with packed_linears(net, 5, min_elements=0) as packed:
            assert packed == 0
    with torch.no_grad(), packed_linears(net, 5, min_elements=0) as packed:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = net(x)
    assert packed == 2 and got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_a_strided_bias_is_read_as_its_values():
    """oneDNN reads the bias as contiguous whatever its strides: a bias that is a view with a stride
    (a fused projection's bias split per head) is packed as a contiguous copy."""
    net, x = Net(), torch.randn(6, 24)
    with torch.no_grad():
        net.up.bias = nn.Parameter(torch.randn(80)[::2])
        net.down.bias = nn.Parameter(torch.randn(7, 1).expand(7, 3)[:, 0])
    want = net(x)
    with torch.no_grad(), packed_linears(net, 6, min_elements=0) as packed:
        got = net(x)
    assert packed == 2
    products_close(got, want, x, net)


def test_weights_from_hooks_or_changed_inside_keep_the_plain_product():
    """A weight a pre-hook recomputes (weight_norm, prune) is not packed; a weight changed inside the
    block (in place, or replaced) sends its layer back to the plain product: never a stale copy."""
    net, x = Net(), torch.randn(4, 24)
    torch.nn.utils.weight_norm(net.up)                              # weight = g v / |v|, before each call
    prune.random_unstructured(net.down, "weight", amount=0.5)
    with torch.no_grad(), packed_linears(net, 4, min_elements=0) as packed:
        assert packed == 0
    net = Net()
    with torch.no_grad(), packed_linears(net, 4, min_elements=0) as packed:
        net.up.weight.mul_(3.0)
        net.down.weight = nn.Parameter(net.down.weight * -1.0)
        got = net(x)
    assert packed == 2 and torch.equal(got, net(x))


def test_gradients_flow_through_the_plain_product():
    """With a gradient needed, the layer is the plain one (oneDNN's packed op has no backward)."""
    net, x = Net(), torch.randn(4, 24, requires_grad=True)
    net(x).square().sum().backward()
    want = [net.up.weight.grad.clone(), x.grad.clone()]
    net.zero_grad(), x.grad.zero_()
    with packed_linears(net, 4, min_elements=0) as packed:
        net(x).square().sum().backward()
    assert packed == 2 and torch.equal(net.up.weight.grad, want[0]) and torch.equal(x.grad, want[1])


def test_compiling_traces_the_plain_product():
    """A compiled model's graph holds the plain linear, not the packed op (inductor has no lowering of
    it); the result is the plain one."""
    seen = []

    def backend(gm, inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes)
        return gm.forward

    net, x = Net(), torch.randn(4, 24)
    compiled = torch.compile(net, backend=backend, dynamic=False)
    with torch.no_grad(), packed_linears(net, 4, min_elements=0) as packed:
        got = compiled(x)
    assert packed == 2 and torch.equal(got, net(x)) and seen and not any("mkldnn" in t for t in seen)


def test_a_lower_float32_matmul_precision_packs_nothing():
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        with torch.no_grad(), packed_linears(Net(), 4, min_elements=0) as packed:
            assert packed == 0
    finally:
        torch.set_float32_matmul_precision(previous)


def test_a_merged_peft_adapter_keeps_its_base_plain():
    """peft unmerges a merged adapter in place inside a forward under ``disable_adapter``: its base
    layer is not packed, and the result is the base model's."""
    peft = pytest.importorskip("peft")
    net, x = Net(), torch.randn(4, 24)
    base = net(x)
    model = peft.inject_adapter_in_model(peft.LoraConfig(r=2, target_modules=["up"], init_lora_weights=False), net)
    model.up.merge()
    model.up.enable_adapters(False)      # its next forward unmerges the base weight in place, then uses it
    with torch.no_grad(), packed_linears(model, 4, min_elements=0) as packed:
        assert "forward" not in model.up.base_layer.__dict__
        got = model(x)
    assert packed == 1 + 2               # down, and the adapter's own A and B
    assert not model.up.merged_adapters
    products_close(got, base, x, Net())


def test_exit_removes_only_its_own_forwards():
    """A forward set by someone else inside the block (a hook, another thread's block) stays."""
    net = Net()
    mine = lambda x: x[..., :40] * 0                                      # noqa: E731
    with torch.no_grad(), packed_linears(net, 4, min_elements=0) as packed:
        net.up.forward = mine
        with packed_linears(net, 4, min_elements=0) as inner:             # both already replaced
            assert inner == 0
    assert packed == 2 and net.up.__dict__["forward"] is mine and "forward" not in net.down.__dict__


def test_an_error_inside_restores_the_layers():
    net = Net()
    with pytest.raises(RuntimeError, match="boom"), torch.no_grad(), packed_linears(net, 4, min_elements=0):
        raise RuntimeError("boom")
    assert not any("forward" in m.__dict__ for m in net.modules())


def test_generate_packed_and_plain_agree_on_builtin_tiny():
    """The sampler with and without packing: the same behaviour log-probs of the same tokens, up to the
    rounding of two forwards (checked on the tokens both drew: a draw may flip where two tokens' CDF
    boundary falls within that rounding)."""
    from creditrl.runtime.models.tiny import TinyModelConfig, char_tokenizer, tiny_model
    from creditrl.runtime.sampling import generate
    from tolerances import logp_atol

    tok = char_tokenizer("0123456789+=")
    # wider than builtin:tiny, so that its MLP weights (256 x 1,024) are packed
    model = tiny_model(tok, TinyModelConfig(hidden_size=256, intermediate_size=1024, num_layers=2), seed=0).eval()
    prompts = [tok.encode("12+34="), tok.encode("7+5=")]
    with torch.no_grad(), packed_linears(model, 8) as packed:
        assert packed == 2 * 3                                   # gate, up, down of both layers
    runs = [generate(model, tok, prompts, group_size=4, temperature=1.0, max_new_tokens=8,
                     generator=torch.Generator().manual_seed(3), packed_weights=packed) for packed in (True, False)]
    same = (runs[0].input_ids == runs[1].input_ids).all(1)
    assert int(same.sum()) >= 6                                  # nearly every row draws the same tokens
    with torch.no_grad():
        scale = float(model(input_ids=runs[1].input_ids, attention_mask=runs[1].attention_mask).logits.abs().max())
    diff = (runs[0].rollout_logp[same] - runs[1].rollout_logp[same]).abs().max()
    assert float(diff) <= logp_atol(model, runs[0].input_ids.shape[1], scale)
