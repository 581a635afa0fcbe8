"""`jetflow bench`: methods, harness, summaries, cost model and reports on a tiny random model."""

import json

import pytest
import torch

from jetflow.cli import main
from jetflow.errors import JetFlowError
from jetflow.decoding.costs import measure_costs, speedup_bound
from jetflow.eval.bench import CURVE_SIZES
from jetflow.eval.harness import summarize
from jetflow.eval.methods import METHODS, MethodRunner, parse_methods
from jetflow.models.checkpoint import load_drafter
from jetflow.models.draft_head import DraftHead, DraftHeadConfig
from jetflow.models.eagle_head import EagleHead
from jetflow.models.target import TargetModel


@pytest.fixture(scope="module")
def heads(tiny_dir, tmp_path_factory):
    target = TargetModel.load(str(tiny_dir))
    root = tmp_path_factory.mktemp("heads")
    paths = {}
    for kind, layers in (("causal", None), ("bidirectional", [0, 1])):
        torch.manual_seed(1)
        if layers:  # the baseline reads other target layers: the runner must switch the taps
            target.set_tapped_layers(layers)
        block = 6 if kind == "causal" else 7  # blocks of their own: each chain method verifies its head's
        head = DraftHead(DraftHeadConfig.for_target(target, block_size=block, attention=kind))
        paths[kind] = head.save_pretrained(root / kind)
    torch.manual_seed(2)
    eagle = EagleHead(DraftHeadConfig.for_target(target, num_hidden_layers=1, block_size=4, kind="eagle3"))
    paths["eagle3"] = eagle.save_pretrained(root / "eagle3")
    return paths


def test_every_method_equals_ar_under_greedy(tiny_dir, heads):
    target = TargetModel.load(str(tiny_dir))
    loaded = {k: load_drafter(p, target=target) for k, p in heads.items()}
    assert isinstance(loaded["eagle3"], EagleHead)
    runner = MethodRunner(target, loaded, width=3)
    prompt = [{"role": "user", "content": "hello there"}]
    ar = runner.run(METHODS["ar"], prompt, budget=None, max_new_tokens=20)
    for name, spec in METHODS.items():
        if spec.backend == "llamacpp":  # llama-ar: refused up front on a torch target
            with pytest.raises(JetFlowError, match="llama.cpp backend"):
                runner.check(spec)
            continue
        result = runner.run(spec, prompt, budget=8 if spec.tree else None, max_new_tokens=20)
        assert result.token_ids == ar.token_ids, name
        assert result.stats["rounds"] >= 1
        if spec.head is not None:
            assert result.stats["rounds"] == len(result.stats["accept_lengths"])
            if spec.name != "torch-jetflow":  # that one runs the torch runtime's default budget (16)
                assert result.stats["mean_tree_size"] <= (8 if spec.tree else 6 if spec.head == "bidirectional" else 5)
    chain = runner.run(METHODS["jetflow-chain"], prompt, budget=None, max_new_tokens=20)
    assert chain.stats["width"] == 1 and chain.stats["budget"] == 5  # block_size - 1 drafts in a path


@pytest.mark.parametrize("refine", [2, "tree"])
def test_refine_modes_reach_the_refine_and_lookup_methods(tiny_dir, refine):
    """--refine N|tree: jetflow-refine runs that second pass, and so does jetflow-lookup (the default
    decoder) with a head trained for it; both still equal ar."""
    target = TargetModel.load(str(tiny_dir))
    torch.manual_seed(3)
    head = DraftHead(DraftHeadConfig.for_target(target, block_size=6, feed_last_feature=True, shift_tokens=True,
                                                path_projection=True))
    head.config.path_refine = True
    runner = MethodRunner(target, {"causal": head}, width=3, refine=refine)
    prompt = [{"role": "user", "content": "hello there"}]
    ar = runner.run(METHODS["ar"], prompt, budget=None, max_new_tokens=20)
    for name in ("jetflow-refine", "jetflow-lookup"):
        runner.check(METHODS[name])
        assert runner.run(METHODS[name], prompt, budget=8, max_new_tokens=20).token_ids == ar.token_ids, name
    for drafter in (runner._refined.drafter, runner._mixed["causal", 8].drafter.primary):
        assert (drafter.refine_tree, drafter.refine) == ((True, 1) if refine == "tree" else (False, 2))


def test_method_list_and_missing_heads(tiny_dir):
    assert [m.name for m in parse_methods("jetflow,pld")] == ["ar", "jetflow", "pld"]  # ar always first
    with pytest.raises(Exception, match="unknown method.*nope.*known: ar, hf, pld"):
        parse_methods("ar,nope")
    runner = MethodRunner(TargetModel.load(str(tiny_dir)), {})
    with pytest.raises(Exception, match="'ddtree' needs a bidirectional draft head: pass --baseline-drafter"):
        runner.check(METHODS["ddtree"])


def _rec(pid, turn, tokens, seconds, rounds, lengths=None, ids=None):
    return {"id": pid, "turn": turn, "new_tokens": tokens, "seconds": seconds, "prefill_seconds": 0.0,
            "rounds": rounds, "accept_lengths": lengths, "time_split": None, "token_ids": ids or [1] * tokens}


def test_summary_formulas_against_hand_computed_values():
    ar = [_rec("a", 0, 10, 1.0, 9), _rec("b", 0, 20, 4.0, 19)]  # 30 tokens in 5 s: 6 tok/s
    spec = [_rec("a", 0, 10, 0.5, 3, [3, 3, 3]), _rec("b", 0, 20, 1.0, 5, [5, 4, 4, 3, 3], ids=[2] * 20)]
    s = summarize(spec, ar, greedy=True)
    assert s["tokens_per_s"] == pytest.approx(20.0) and s["speedup"] == pytest.approx(20 / 6)
    assert s["speedup_per_prompt_mean"] == pytest.approx((2.0 + 4.0) / 2)  # per prompt: 20/10, 20/5
    assert s["tau"] == pytest.approx(28 / 8)
    assert s["accept_histogram"] == {"3": 5, "4": 2, "5": 1}
    assert s["per_depth_acceptance"] == pytest.approx([1.0, 1.0, 3 / 8, 1 / 8])
    assert s["mismatches"] == ["b#0"]
    assert summarize(ar, ar, greedy=True)["tau"] == pytest.approx(1.0)  # 28 tokens after prefill / 28 forwards
    # A last round that accepted past the length limit: tau counts its 5, the output kept 3 of them.
    cut = summarize([_rec("c", 0, 10, 1.0, 3, [3, 3, 5])], None, greedy=False)
    assert cut["tau"] == pytest.approx(11 / 3) and cut["tokens_per_round"] == pytest.approx(9 / 3)
    assert "mismatches" not in summarize(spec, ar, greedy=False)


def test_cost_model_measures_and_leaves_the_target_clean(tiny_dir, heads, monkeypatch):
    from jetflow.decoding.block_drafter import BlockDrafter
    from jetflow.decoding.mixed_drafter import MixedDrafter

    target = TargetModel.load(str(tiny_dir))
    drafter = MixedDrafter(BlockDrafter(DraftHead.from_pretrained(heads["causal"], target=target), target), target)
    extended, proposed, real_extend, real_propose = [], [], BlockDrafter.extend, BlockDrafter.propose

    def extend(self, features):
        extended.append((self is drafter.primary, features.shape[0]))
        return real_extend(self, features)

    def propose(self, anchor, position, *a, **k):
        proposed.append((position, self.context_len + sum(f.shape[0] for f in self._pending)))
        return real_propose(self, anchor, position, *a, **k)

    monkeypatch.setattr(BlockDrafter, "extend", extend)
    monkeypatch.setattr(BlockDrafter, "propose", propose)
    counts = drafter.calibration.trials.copy(), drafter.calibration.hits.copy(), drafter.calibration.version
    costs = measure_costs(target, [4, 16], drafter, context=32, reps=2)
    assert costs["c1_ms"] > 0 and set(costs["verify_ms"]) == {4, 16} and set(costs["draft_ms"]) == {4, 16}
    assert costs["verify_ratio"][4] == pytest.approx(costs["verify_ms"][4] / costs["c1_ms"])
    assert target.past_len == 0
    assert speedup_bound(3.0, costs, 4) == pytest.approx(
        3.0 * costs["c1_ms"] / (costs["draft_ms"][4] + costs["verify_ms"][4]))
    # Per size, from the prefix: each draft (warm-up included) projects the two tokens the verify
    # before it committed, at the target's position; a twin is timed, and the drafter's own context
    # and lookup counts are untouched (the timed rounds' made-up tokens are no chains the target followed).
    assert extended == [(False, 32), (False, 2), (False, 2), (False, 2)] * 2
    assert proposed == [(34, 34), (36, 36), (38, 38)] * 2
    assert drafter.primary.context_len == 0 and not drafter.primary._pending
    assert (drafter.calibration.trials == counts[0]).all() and (drafter.calibration.hits == counts[1]).all()
    assert drafter.calibration.version == counts[2]


def test_bench_cli_outputs_resume_and_mismatch_failure(tiny_dir, heads, tmp_path, capsys, monkeypatch):
    args = ["bench", "--target", str(tiny_dir), "--drafter", str(heads["causal"]), "--baseline-drafter",
            str(heads["bidirectional"]), "--eagle-drafter", str(heads["eagle3"]), "--datasets",
            "gsm8k,mtbench,humaneval", "--limit", "1", "--methods",
            "ar,hf,pld,dflash,ddtree,jetflow,jetflow-chain,eagle3,eagle3-lookup",
            "--budgets", "4,8,auto",
            "--max-new-tokens", "6", "--width", "3", "--out", str(tmp_path / "b")]
    monkeypatch.setenv("JETFLOW_CACHE", str(tmp_path / "cache"))  # where 'auto' keeps the cost curve
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["runs"] == 3 * 17 and sorted(out["plots"]) == ["speedup_vs_budget.png", "tau_vs_budget.png"]
    run = json.loads((tmp_path / "b" / "runs" / "mtbench__jetflow__b8.json").read_text())
    assert [r["turn"] for r in run["records"]] == [0, 1]  # two MT-Bench turns
    assert run["summary"]["mismatches"] == [] and run["summary"]["prompts"] == 1
    auto = json.loads((tmp_path / "b" / "runs" / "gsm8k__jetflow__bauto.json").read_text())
    assert all(r["features"] in (True, False) for r in auto["records"])  # whether the turn read target features
    auto = auto["summary"]
    assert auto["mismatches"] == [] and 0 <= auto["mean_tree_size"] <= 256  # 0: plain steps only
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    # the budgets, 5 and 6 = the chains of each head's block_size - 1, and the curve every report shows
    assert summary["cost_model"]["verify_ms"].keys() == {"4", "5", "6", "8"} | {str(n) for n in CURVE_SIZES}
    assert summary["cost_model"]["draft_ms"].keys() == {"causal", "bidirectional", "eagle3"}
    assert "| gsm8k | eagle3 | 8 |" in (tmp_path / "b" / "summary.md").read_text()
    mixed = json.loads((tmp_path / "b" / "runs" / "gsm8k__eagle3-lookup__b8.json").read_text())["summary"]
    assert mixed["mismatches"] == [] and mixed["prompts"] == 1  # the EAGLE tree with lookup merged in
    md = (tmp_path / "b" / "summary.md").read_text()
    assert "| gsm8k | ddtree | 8 |" in md and "## Cost model" in md and "**NO" not in md
    assert "| gsm8k | jetflow-chain | 5 |" in md and "| gsm8k | dflash | 6 |" in md  # priced at their own lengths

    from jetflow.eval import methods

    calls = []
    real = methods.MethodRunner.run

    def spy(self, spec, *a, **k):
        calls.append(spec.name)
        result = real(self, spec, *a, **k)
        if spec.name == "pld":
            result.token_ids = result.token_ids[:-1] + [5]  # a corrupted output must fail the run
        return result

    monkeypatch.setattr(methods.MethodRunner, "run", spy)
    (tmp_path / "b" / "runs" / "gsm8k__pld.json").unlink()
    assert main(args + ["--no-cost-model"]) == 1
    assert set(calls) == {"pld"}  # every other run was reused from its JSON
    assert "LOSSLESSNESS VIOLATION: pld on gsm8k" in capsys.readouterr().err
    assert main(args[:4] + [str(heads["bidirectional"])] + args[5:]) == 2
    assert "the causal methods need a causal head; the given one (--drafter) is bidirectional" in capsys.readouterr().err

    target = TargetModel.load(str(tiny_dir))
    torch.manual_seed(2)
    DraftHead(DraftHeadConfig.for_target(target, block_size=6)).save_pretrained(tmp_path / "other")
    calls.clear()  # another causal drafter: its stored runs are not replaced unless asked, ...
    other = args[:4] + [str(tmp_path / "other")] + args[5:] + ["--methods", "ar,hf,jetflow"]
    assert main(other) == 2 and not calls
    assert "made with other settings" in capsys.readouterr().err
    assert main(other + ["--overwrite"]) == 0  # ... and then its runs are redone, the drafter-free ones reused
    assert set(calls) == {"jetflow"}


def test_interleaved_runs_rotate_per_prompt_and_match_sequential_runs(tiny_dir, heads, tmp_path, monkeypatch):
    from jetflow.eval import methods
    from jetflow.eval.datasets import EvalPrompt
    from jetflow.eval.harness import BenchSettings, run_benchmark

    target = TargetModel.load(str(tiny_dir))
    runner = MethodRunner(target, {"causal": load_drafter(heads["causal"], target=target)}, width=3)
    prompts = [EvalPrompt("mine", f"p{i}", (f"question {i}",)) for i in range(4)]
    settings = BenchSettings(target="tiny", drafters={"causal": str(heads["causal"])}, max_new_tokens=6)
    calls = []
    real = methods.MethodRunner.run

    def spy(self, spec, request, *, budget, max_new_tokens, **k):
        if max_new_tokens == settings.max_new_tokens:  # not the 8-token warm-up call
            calls.append((spec.name, budget, request[-1]["content"]))
        return real(self, spec, request, budget=budget, max_new_tokens=max_new_tokens, **k)

    monkeypatch.setattr(methods.MethodRunner, "run", spy)
    specs = parse_methods("jetflow,lookup")
    runs = run_benchmark(runner, specs, {"mine": prompts}, [4], settings, tmp_path / "i", progress=False)
    order = [(m, b) for m, b, _ in calls]
    plan = [("ar", None), ("jetflow", 4), ("lookup", None)]
    # every prompt through every run before the next prompt, the order rotating by one per prompt
    assert [q for _, _, q in calls] == [f"question {i}" for i in range(4) for _ in range(3)]
    assert order == [plan[(i + k) % 3] for i in range(4) for k in range(3)]
    calls.clear()
    seq = run_benchmark(runner, specs, {"mine": prompts}, [4], settings, tmp_path / "s", progress=False,
                        interleave=False)
    assert [(m, b) for m, b, _ in calls] == [p for p in plan for _ in range(4)]  # one run after another
    for a, b in zip(runs, seq):
        assert [r["token_ids"] for r in a["records"]] == [r["token_ids"] for r in b["records"]]
        assert [r["id"] for r in a["records"]] == [f"p{i}" for i in range(4)] and a["summary"]["mismatches"] == []
    (tmp_path / "i" / "runs" / "mine__lookup.json").unlink()
    calls.clear()  # stored runs are reused; only the missing one is run again
    run_benchmark(runner, specs, {"mine": prompts}, [4], settings, tmp_path / "i", progress=False)
    assert {m for m, _, _ in calls} == {"lookup"} and len(calls) == 4
    # other settings into the same directory: refused before anything runs, every stored run kept ...
    stored = {p.name: p.read_bytes() for p in (tmp_path / "i" / "runs").iterdir()}
    shorter = BenchSettings(target="tiny", drafters={"causal": str(heads["causal"])}, max_new_tokens=5)
    calls.clear()
    with pytest.raises(JetFlowError, match=r"3 run\(s\) made with other settings.*max_new_tokens 6 \(now 5\)"):
        run_benchmark(runner, specs, {"mine": prompts}, [4], shorter, tmp_path / "i", progress=False)
    assert not calls and stored == {p.name: p.read_bytes() for p in (tmp_path / "i" / "runs").iterdir()}
    # ... unless asked to replace them
    run_benchmark(runner, specs, {"mine": prompts}, [4], shorter, tmp_path / "i", progress=False, overwrite=True)
    assert json.loads((tmp_path / "i" / "runs" / "mine__ar.json").read_text())["key"]["max_new_tokens"] == 5


def test_side_by_side_rows_and_their_comparison(tiny_dir, heads, capsys):
    from jetflow.eval.datasets import EvalPrompt
    from jetflow.eval.harness import BenchSettings, compare_rows, print_comparison, run_side_by_side

    target = TargetModel.load(str(tiny_dir))
    runner = MethodRunner(target, {"causal": load_drafter(heads["causal"], target=target)}, width=3)
    prompts = [EvalPrompt("mine", f"p{i}", (f"question {i}",)) for i in range(3)]
    settings = BenchSettings(target="tiny", drafters={}, max_new_tokens=6)
    runs = [(METHODS["ar"], None), (METHODS["jetflow"], 4), (METHODS["lookup"], None)]
    rows = run_side_by_side(runner, runs, prompts, settings, "mine")
    assert list(rows) == ["ar", "jetflow@4", "lookup"]
    printed = capsys.readouterr().out.splitlines()
    for name, row in rows.items():
        assert [r["id"] for r in row["records"]] == ["p0", "p1", "p2"]
        assert row["summary"].get("mismatches", []) == []  # every greedy output equals the first run's
        assert any(line.split()[:2] == ["mine", name] for line in printed)
        s = row["summary"]
        assert s["tokens_per_s"] == pytest.approx(s["new_tokens"] / s["seconds"])
    assert tuple(rows["ar"]["summary"]["ci95"]) == (1.0, 1.0)
    c = compare_rows(rows["jetflow@4"], rows["ar"])
    assert c["ratio"] == pytest.approx(rows["jetflow@4"]["summary"]["speedup"])
    lo, hi = c["ci95"]
    assert lo <= hi and (lo, hi) == tuple(rows["jetflow@4"]["summary"]["ci95"])
    assert print_comparison("mine jetflow / ar", rows["jetflow@4"], rows["ar"]) == c
    assert capsys.readouterr().out == f"mine jetflow / ar {c['ratio']:.2f}x [{lo:.2f}-{hi:.2f}]\n"
    one = {k: {"summary": r["summary"], "records": r["records"][:1]} for k, r in rows.items()}
    assert print_comparison("one", one["jetflow@4"], one["ar"])["ci95"] is None  # one prompt: no interval
    assert capsys.readouterr().out == f"one {compare_rows(one['jetflow@4'], one['ar'])['ratio']:.2f}x\n"


@pytest.mark.parametrize("extra, message", [
    (["--methods", "ar,dflash"], "pass --baseline-drafter"),
    (["--methods", "eagle3"], "'eagle3' needs a eagle3 draft head: pass --eagle-drafter"),
    (["--datasets", "nope"], "unknown evaluation set 'nope'"),
    (["--budgets", "4,x"], "--budgets must be comma-separated integers in [1, 256] or 'auto'"),
    (["--budgets", "0"], "--budgets must be comma-separated integers in [1, 256] or 'auto'"),
    (["--budgets", "16,300"], "--budgets must be comma-separated integers in [1, 256] or 'auto'"),
    (["--temperature", "-1"], "temperature must be a finite number >= 0"),
    (["--temperature", "0.7", "--methods", "llama-ar,ar"], "llama-ar decodes greedily only: drop it"),
    (["--temperature", "0.7", "--methods", "llama-dflash,llama-ar"], "llama-dflash, llama-ar decode greedily only"),
    (["--drafter", "/no/such/dir"], "drafter checkpoint directory not found"),
])
def test_bench_bad_input(tiny_dir, tmp_path, capsys, extra, message):
    assert main(["bench", "--target", str(tiny_dir), "--out", str(tmp_path / "o"), "--limit", "1"] + extra) == 2
    assert message in capsys.readouterr().err


def test_bench_out_must_be_a_writable_directory(tiny_dir, tmp_path, capsys):
    kept = tmp_path / "results.txt"
    kept.write_text("precious")
    assert main(["bench", "--target", str(tiny_dir), "--out", str(kept), "--limit", "1", "--methods", "ar"]) == 2
    assert f"--out {kept} is a file, not a directory" in capsys.readouterr().err and kept.read_text() == "precious"


def test_jsonl_prompt_files_must_be_utf8_and_may_start_with_a_bom(tmp_path):
    from jetflow.eval.datasets import load_eval_set

    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(JetFlowError, match=r"latin.jsonl:1: not UTF-8 text"):
        load_eval_set(str(latin))
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b'\xef\xbb\xbf{"prompt": "caf\xc3\xa9"}\n')
    assert load_eval_set(str(bom))[0].turns == ("caf\u00e9",)


def test_bench_on_a_users_jsonl_file_with_categories(tiny_dir, heads, tmp_path, capsys):
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in [
        {"id": "t1", "prompt": "Translate: bonjour le monde", "category": "translate"},
        {"question": "What is 2+2?", "category": "math"},
        {"turns": ["Write a haiku.", "Now another."], "category": "writing"},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Summarize: a b c"}],
         "category": "translate"},
        {"question": "Name a color."},  # no category: its own "(none)" row
    ]) + "\n")
    args = ["bench", "--target", str(tiny_dir), "--drafter", str(heads["causal"]), "--datasets", str(prompts),
            "--methods", "ar,jetflow,jetflow-lookup", "--budgets", "4", "--max-new-tokens", "6", "--no-cost-model",
            "--out", str(tmp_path / "b")]
    assert main(args) == 0
    run = json.loads((tmp_path / "b" / "runs" / "mine__jetflow-lookup__b4.json").read_text())
    cats = run["summary"]["by_category"]
    assert sorted(cats) == ["(none)", "math", "translate", "writing"] and cats["translate"]["prompts"] == 2
    assert cats["(none)"]["prompts"] == 1
    assert cats["writing"]["turns"] == 2 and all(c["mismatches"] == [] for c in cats.values())
    assert sum(c["new_tokens"] for c in cats.values()) == run["summary"]["new_tokens"]
    md = (tmp_path / "b" / "summary.md").read_text()
    assert "## Per category" in md and "| mine | jetflow-lookup | 4 | translate | 2 |" in md
    capsys.readouterr()
    prompts.write_text(json.dumps({"question": "What is 3+3?"}) + "\n")  # edited file: runs are redone, said
    assert main(args) == 0
    assert "mine__ar.json was made with other prompts or settings; it is measured again" in capsys.readouterr().err
    run = json.loads((tmp_path / "b" / "runs" / "mine__ar.json").read_text())
    assert run["summary"]["prompts"] == 1 and "by_category" not in run["summary"]
    other = tmp_path / "sub" / "mine.jsonl"  # another file of the same name is another set: not replaced silently
    other.parent.mkdir()
    other.write_text(json.dumps({"question": "What is 3+3?"}) + "\n")
    capsys.readouterr()
    assert main([*args[:6], str(other), *args[7:]]) == 2
    err = capsys.readouterr().err
    assert "prompt_file" in err and str(other.resolve()) in err and "--overwrite" in err
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert summary["settings"]["extra"]["draft_weights"] == "int8"  # the CPU default, recorded
    long = tmp_path / "long.jsonl"  # one prompt past the context, last in its file: refused before any prompt runs
    long.write_text(json.dumps({"question": "Hi"}) + "\n" + json.dumps({"id": "big", "question": "word " * 3000}) + "\n")
    assert main([*args[:6], str(long), *args[7:-1], str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert "1 prompt(s) do not fit the model's context" in err and f"big ({long.resolve()}):" in err
    assert not (tmp_path / "c" / "runs").exists() or not any((tmp_path / "c" / "runs").iterdir())
    assert main(args + ["--draft-weights", "float", "--out", str(tmp_path / "f")]) == 0
    assert json.loads((tmp_path / "f" / "summary.json").read_text())["settings"]["extra"]["draft_weights"] == "float"


def test_text_compared_methods_ignore_how_the_text_was_split():
    """llama-dflash's ids are its printed text tokenized again: it is compared with the reference as text."""
    ref = [{"id": "p", "turn": 0, "new_tokens": 2, "seconds": 1.0, "rounds": 1, "accept_lengths": None,
            "time_split": None, "prefill_seconds": 0.0, "token_ids": [1, 23]}]
    same_text = [dict(ref[0], token_ids=[12, 3])]
    other = [dict(ref[0], token_ids=[12, 4])]
    text = lambda ids: "".join(map(str, ids))  # noqa: E731
    assert summarize(same_text, ref, True, as_text=text)["mismatches"] == []
    assert summarize(other, ref, True, as_text=text)["mismatches"] == ["p#0"]
    assert summarize(same_text, ref, True)["mismatches"] == ["p#0"]  # token for token otherwise
    cut = [dict(ref[0], token_ids=[12], finish_reason="length")]  # its ids, cut at max_new_tokens, cover less of the same text
    assert summarize(cut, ref, True, as_text=text)["mismatches"] == []
    stopped = [dict(cut[0], finish_reason="stop")]  # an answer that ended by itself must be all of the reference's
    assert summarize(stopped, ref, True, as_text=text)["mismatches"] == ["p#0"]
    assert summarize([dict(ref[0], token_ids=[], finish_reason="stop")], ref, True, as_text=text)["mismatches"] == ["p#0"]
    longer = [dict(ref[0], token_ids=[1, 234])]  # longer than a reference that stopped by itself
    assert summarize(longer, [dict(ref[0], finish_reason="stop")], True, as_text=text)["mismatches"] == ["p#0"]
    assert summarize(longer, [dict(ref[0], finish_reason="length")], True, as_text=text)["mismatches"] == []
    assert not METHODS["llama-dflash"].exact_tokens and METHODS["jetflow"].exact_tokens


def test_speedup_interval_against_exact_enumeration():
    """Three prompts: the bootstrap's 27 equally likely resamples enumerated exactly; its percentile
    interval must land on the exact distribution's quantiles (within a resample step)."""
    import itertools

    from jetflow.eval.bootstrap import speedup_interval

    ref = [_rec("a", 0, 10, 1.0, 9), _rec("b", 0, 10, 1.0, 9), _rec("b", 1, 10, 2.0, 9), _rec("c", 0, 30, 3.0, 29)]
    run = [_rec("a", 0, 10, 0.5, 9), _rec("b", 0, 10, 1.0, 9), _rec("b", 1, 10, 1.0, 9), _rec("c", 0, 30, 4.0, 29)]
    sums = {"a": (10, 0.5, 10, 1.0), "b": (20, 2.0, 20, 3.0), "c": (30, 4.0, 30, 3.0)}  # turns of b summed
    exact = sorted((sum(sums[p][0] for p in pick) / sum(sums[p][1] for p in pick))
                   / (sum(sums[p][2] for p in pick) / sum(sums[p][3] for p in pick))
                   for pick in itertools.product("abc", repeat=3))
    low, high = speedup_interval(run, ref, confidence=0.8, resamples=20000)
    assert exact[1] <= low <= exact[3] and exact[-4] <= high <= exact[-2]
    assert low < summarize(run, ref, greedy=False)["speedup"] < high
    assert speedup_interval(ref, ref) == (pytest.approx(1.0), pytest.approx(1.0))  # a run against itself
    assert speedup_interval(run[:1], ref) is None  # one prompt: no interval
    assert summarize(run, ref, greedy=False)["speedup_ci95"] == speedup_interval(run, ref)  # deterministic


def test_a_drafter_changed_in_place_is_not_taken_for_its_stored_runs(tiny_dir, heads, tmp_path, capsys):
    """Runs are keyed by the checkpoint files' digests: a head calibrated or retrained in place is
    another drafter (its stored runs are refused, not reused), while the runs without a head are
    still shared."""
    import shutil

    head = tmp_path / "head"
    shutil.copytree(heads["causal"], head)
    args = ["bench", "--target", str(tiny_dir), "--drafter", str(head), "--datasets", "gsm8k", "--limit", "1",
            "--methods", "ar,jetflow", "--budgets", "4", "--max-new-tokens", "6", "--width", "3",
            "--no-cost-model", "--out", str(tmp_path / "b")]
    assert main(args) == 0
    assert main(args) == 0  # unchanged: everything reused
    config = json.loads((head / "config.json").read_text())
    config["tree_calibration"] = None  # any edit of its files
    (head / "config.json").write_text(json.dumps(config, indent=1))
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "made with other settings" in err and "gsm8k__jetflow__b4.json" in err and "gsm8k__ar.json" not in err


def test_greedy_outputs_that_change_between_repeats_are_reported(capsys):
    from jetflow.eval.harness import report_mismatches

    record = {"id": "p", "turn": 0, "new_tokens": 2, "seconds": 1.0, "rounds": 1, "accept_lengths": None,
              "time_split": None, "prefill_seconds": 0.0, "token_ids": [1, 2], "repeats_differ": True}
    summary = summarize([record], None, True)
    assert summary["repeats_differ"] == ["p#0"]
    assert "repeats_differ" not in summarize([record], None, False)  # sampling: repeats differ by design
    assert report_mismatches([{"method": "jetflow", "dataset": "gsm8k", "budget": 4, "summary": summary}], True) == 1
    assert "NON-DETERMINISM: jetflow on gsm8k" in capsys.readouterr().err


def test_what_changes_speed_is_in_a_runs_key_and_budgets_keep_their_own_lookup_counts(tiny_dir, heads, monkeypatch,
                                                                                       tmp_path):
    """A run stored at other threads, dtype, device or backend is not taken for this one; every
    method is named in the reports' order; each budget of jetflow-lookup keeps its own lookup counts
    (budgets timed side by side would otherwise price each other's chains)."""
    from jetflow.eval.bench import runtime_settings
    from jetflow.eval.harness import BenchSettings
    from jetflow.eval.report import ORDER

    assert set(METHODS) <= set(ORDER)
    target = TargetModel.load(str(tiny_dir))
    runtime = runtime_settings(target)
    assert runtime == {"backend": "torch", "device": "cpu", "dtype": "float32", "threads": torch.get_num_threads(),
                       "flash_attn": False}
    keys = []
    for threads in (1, 2):
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
        settings = BenchSettings(target="tiny", drafters={}, extra={"runtime": runtime_settings(target)})
        keys.append(settings.run_key(METHODS["ar"], "gsm8k", None, ["a"]))
    assert keys[0] != keys[1]
    from jetflow.eval.harness import stored_conflicts

    before = dict(keys[0], extra={})  # a run stored before keys named the runtime: timed again, not refused
    (tmp_path / "r.json").write_text(json.dumps({"key": before}))
    assert stored_conflicts([(tmp_path / "r.json", keys[0])]) == []
    (tmp_path / "r.json").write_text(json.dumps({"key": keys[1]}))
    assert stored_conflicts([(tmp_path / "r.json", keys[0])])  # another thread count: refused by name
    runner = MethodRunner(target, {"causal": load_drafter(heads["causal"], target=target)}, width=3)
    prompt = [{"role": "user", "content": "hello there"}]
    for budget in (4, 8):
        runner.run(METHODS["jetflow-lookup"], prompt, budget=budget, max_new_tokens=8)
    assert runner._mixed["causal", 4].drafter.calibration is not runner._mixed["causal", 8].drafter.calibration


def test_auto_is_warmed_apart_from_the_fixed_budgets(tiny_dir, heads, tmp_path, monkeypatch):
    """`auto` makes its cost curve and budget state on its first request: its warm-up call must come
    before its timed prompts, even when a fixed budget of the same method was warmed already."""
    from jetflow.eval import methods

    calls = []
    real = methods.MethodRunner.run
    monkeypatch.setattr(methods.MethodRunner, "run",
                        lambda self, spec, prompt, budget=None, max_new_tokens=0, **k:
                        calls.append((spec.name, budget, max_new_tokens)) or real(self, spec, prompt, budget=budget,
                                                                                  max_new_tokens=max_new_tokens, **k))
    monkeypatch.setenv("JETFLOW_CACHE", str(tmp_path / "cache"))
    assert main(["bench", "--target", str(tiny_dir), "--drafter", str(heads["causal"]), "--datasets", "gsm8k",
                 "--limit", "1", "--methods", "jetflow", "--budgets", "4,auto", "--max-new-tokens", "6",
                 "--no-cost-model", "--out", str(tmp_path / "b")]) == 0
    auto = [c for c in calls if c[:2] == ("jetflow", "auto")]
    assert auto[0][2] == 8 and any(c[2] == 6 for c in auto)  # warmed (8 tokens), then timed

