"""Few-row linear layers as W @ x^T (and one row as two): the same numbers as nn.Linear up to
rounding, chosen once per machine, and lossless decoding with them."""

import json

import pytest
import torch
from torch import nn

import jetflow
from jetflow.models import few_row_linear
from jetflow.models.few_row_linear import (ENV, LAYERS, MAX_ROWS, FewRowLinear, PairedRowLinear, cached_choice,
                                          use_few_row_linear)
from jetflow.models.target import TargetModel
from tiny import tiny_model


@pytest.mark.parametrize("cls", [FewRowLinear, PairedRowLinear])
@pytest.mark.parametrize("bias", [False, True])
def test_few_row_linear_equals_linear_and_leaves_big_batches_alone(bias, cls):
    torch.manual_seed(0)
    layer = nn.Linear(48, 80, bias=bias)
    few = cls(48, 80, bias=bias)
    few.load_state_dict(layer.state_dict())
    for shape in [(1, 48), (1, 1, 48), (2, 48), (1, 7, 48), (3, 5, 48), (MAX_ROWS, 48), (1, MAX_ROWS + 1, 48)]:
        x = torch.randn(*shape)
        want, got = layer(x), few(x)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        rows = x.numel() // 48
        if (rows == 1 and cls is FewRowLinear) or rows > MAX_ROWS:  # untouched: bit for bit nn.Linear
            assert torch.equal(got, want)
    # the brute-force reference: every output is the dot product of its row and the weight's row
    few64 = few.double()
    for rows in (1, 4):
        x = torch.randn(rows, 48, dtype=torch.float64)
        ref = torch.stack([torch.stack([(x[i] * few64.weight[j]).sum() for j in range(80)]) for i in range(rows)])
        if bias:
            ref = ref + few64.bias
        torch.testing.assert_close(few64(x), ref)


def test_the_form_is_forced_by_env_refused_when_unknown_and_keeps_the_weights(monkeypatch):
    model = tiny_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    monkeypatch.setenv(ENV, "standard")
    assert use_few_row_linear(model) == "standard"
    assert not any(isinstance(m, FewRowLinear) for m in model.modules())
    monkeypatch.setenv(ENV, "transposed")
    assert use_few_row_linear(model) == "transposed"
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is FewRowLinear for m in linears)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert use_few_row_linear(model, form="transposed") == "transposed"  # again: nothing changes
    monkeypatch.setenv(ENV, "paired")
    assert use_few_row_linear(model) == "paired"
    assert all(type(m) is PairedRowLinear for m in linears)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert use_few_row_linear(model, form="standard") == "standard"  # and back
    assert all(type(m) is nn.Linear for m in linears)
    monkeypatch.setenv(ENV, "fastest")
    with pytest.raises(ValueError, match=ENV):
        use_few_row_linear(tiny_model("llama"))


def test_the_choice_is_measured_once_per_machine_and_a_damaged_record_measured_again(tmp_path, monkeypatch):
    calls = []

    def probe(weights, reps=5):
        calls.append([tuple(w.shape) for w in weights])
        return "paired", {"standard": 2.0, "transposed": 1.0, "standard_one_row": 2.0, "paired_one_row": 1.0}

    monkeypatch.setattr(few_row_linear, "fastest_form", probe)
    linears = [m for m in tiny_model("llama").modules() if type(m) is nn.Linear]
    assert cached_choice(linears, tmp_path) == "paired"
    assert cached_choice(linears, tmp_path) == "paired"
    assert len(calls) == 1
    record = next((tmp_path / "linear_form").glob("*.json"))
    assert json.loads(record.read_text())["form"] == "paired"
    assert max(calls[0]) == max(tuple(m.weight.shape) for m in linears)  # the largest layer is timed
    record.write_text("{not json")
    assert cached_choice(linears, tmp_path) == "paired" and len(calls) == 2
    stored = json.loads(record.read_text())
    record.write_text(json.dumps({"key": stored["key"], "transposed": True}))  # a record without a form
    assert cached_choice(linears, tmp_path) == "paired" and len(calls) == 3


@pytest.mark.parametrize("ms, form", [
    ({"standard": 10.0, "transposed": 9.5, "standard_one_row": 10.0, "paired_one_row": 1.0}, "standard"),
    ({"standard": 10.0, "transposed": 8.0, "standard_one_row": 10.0, "paired_one_row": 9.5}, "transposed"),
    ({"standard": 10.0, "transposed": 8.0, "standard_one_row": 10.0, "paired_one_row": 8.0}, "paired"),
])
def test_the_probe_picks_a_form_only_where_it_is_ten_percent_faster(monkeypatch, ms, form):
    """Each probe call runs its layer; a stand-in for ``median_ms`` returns fixed times by the
    layer's class and row count (the two probe row counts share a form's time)."""
    calls = {"standard": 0, "transposed": 0, "standard_one_row": 0, "paired_one_row": 0}
    current = {}

    def median(fn, reps):
        current.clear()
        fn()
        name = {nn.Linear: "standard", FewRowLinear: "transposed", PairedRowLinear: "paired"}[current["cls"]]
        key = name if current["rows"] > 1 else f"{name}_one_row"
        calls[key] += 1
        return ms[key] / (len(few_row_linear.PROBE_ROWS) if current["rows"] > 1 else 1)

    for cls in LAYERS.values():
        original = cls.forward

        def forward(self, x, original=original):
            current.update(cls=type(self), rows=x.numel() // x.shape[-1])
            return original(self, x)

        monkeypatch.setattr(cls, "forward", forward)
    monkeypatch.setattr(few_row_linear, "median_ms", median)
    chosen, got = few_row_linear.fastest_form([torch.randn(64, 32)], reps=1)
    assert chosen == form
    assert calls == {"standard": 2, "transposed": 2, "standard_one_row": 1, "paired_one_row": 1}
    assert got == pytest.approx(ms)


def test_the_probe_measures_every_form():
    form, times = few_row_linear.fastest_form([torch.randn(64, 32)], reps=3)
    assert form in LAYERS and set(times) == {"standard", "transposed", "standard_one_row", "paired_one_row"}
    assert all(t > 0 for t in times.values())


@pytest.fixture(params=["transposed", "paired"])
def transposed_target(tokenizer, monkeypatch, request):
    monkeypatch.setenv(ENV, request.param)
    target = TargetModel(tiny_model("llama"), tokenizer, name="tiny", tapped_layers=[0, 2])
    assert target.linear_form == request.param
    return target


def test_tree_verify_with_few_row_products_equals_each_path_alone(transposed_target, tokenizer, monkeypatch):
    monkeypatch.setenv(ENV, "standard")
    plain = TargetModel(tiny_model("llama"), tokenizer, name="tiny", tapped_layers=[0, 2])
    assert plain.linear_form == "standard"
    prefix, tokens, parents = [5, 9, 13, 17, 21], [30, 31, 32, 33, 34, 35], [-1, 0, 0, 1, 1, 2]
    transposed_target.prefill(prefix)
    tree = transposed_target.verify(tokens, parents)
    for node in range(len(tokens)):
        path, n = [], node
        while n >= 0:
            path.append(tokens[n])
            n = parents[n]
        plain.prefill(prefix + path[::-1][:-1])
        alone = plain.verify([path[0]], [-1])  # the node itself, after its ancestors, one row
        torch.testing.assert_close(tree.logits[node], alone.logits[0], rtol=1e-4, atol=1e-4)
        assert int(tree.logits[node].argmax()) == int(alone.logits[0].argmax())


def test_greedy_speculative_with_few_row_products_equals_autoregressive(transposed_target):
    torch.manual_seed(0)
    from jetflow.models.draft_head import DraftHead, DraftHeadConfig

    head = DraftHead(DraftHeadConfig.for_target(transposed_target, attention="causal", block_size=8))
    prompt = [10, 20, 30, 40, 50]
    ar = jetflow.generate(transposed_target, prompt, max_new_tokens=40)
    spec = jetflow.JetFlow(transposed_target, head).generate(prompt, max_new_tokens=40, budget=16, width=7)
    assert spec.token_ids == ar.token_ids and spec.stats["rounds"] < len(ar.token_ids)


def test_a_head_drafts_with_few_row_products_where_its_target_does_and_int8_still_quantizes(transposed_target):
    from jetflow.decoding.block_drafter import BlockDrafter
    from jetflow.models.draft_head import DraftHead, DraftHeadConfig

    torch.manual_seed(0)
    head = DraftHead(DraftHeadConfig.for_target(transposed_target, attention="causal", block_size=8))
    float_drafter = BlockDrafter(head, transposed_target)
    assert float_drafter.few_rows and all(type(m) is FewRowLinear for m in head.modules() if isinstance(m, nn.Linear))
    int8_drafter = BlockDrafter(head, transposed_target, int8=True)
    assert not int8_drafter.few_rows
    assert not any(type(m) in (nn.Linear, FewRowLinear) for m in int8_drafter.run_head.layers.modules())
    prefix = [5, 9, 13, 17, 21, 25]
    out = transposed_target.prefill(prefix)
    float_drafter.extend(out.hidden)
    few = float_drafter.head_logprobs(prefix[-1], len(prefix))
    float_drafter.few_rows = False
    plain = float_drafter.head_logprobs(prefix[-1], len(prefix))
    assert few.shape == plain.shape and few.shape[0] == 7
    torch.testing.assert_close(few, plain, rtol=1e-4, atol=1e-4)


def test_a_layer_after_a_few_row_layer_hands_blas_its_rows_in_the_fast_layout(monkeypatch):
    """A few-row layer's output is a transposed view; the next layer (an MLP's down projection,
    after elementwise ops that keep that layout) must still pass x^T to BLAS as the transpose of a
    row-major x (strides (1, k)), the layout MKL multiplies fast."""
    torch.manual_seed(0)
    up, down = FewRowLinear(48, 80, bias=False), FewRowLinear(80, 48, bias=False)
    seen = []
    real_mm = torch.mm

    def mm(a, b):
        seen.append(b.stride())
        return real_mm(a, b)

    monkeypatch.setattr(torch, "mm", mm)
    x = torch.randn(1, 3, 48)
    hidden = torch.nn.functional.silu(up(x)) * up(x)
    assert hidden.stride()[-1] != 1  # the layout the fix is for
    out = down(hidden)
    assert seen[-1] == (1, 80)
    monkeypatch.setattr(torch, "mm", real_mm)
    want = torch.nn.functional.linear(torch.nn.functional.silu(x @ up.weight.T) * (x @ up.weight.T), down.weight)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
