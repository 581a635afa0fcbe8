"""`jetflow bench`: every (dataset, method, budget) run on the same prompts, with raw per-prompt
numbers, summaries against the autoregressive baseline, and an equality check of every output.

A run is saved as one JSON file; a rerun with the same settings reuses it, so a killed sweep resumes
where it stopped. By default a dataset's runs are timed interleaved, prompt by prompt, so that
no method is favoured by when it ran (they are then saved when the dataset ends).
"""

from __future__ import annotations

import hashlib
import json
import statistics
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from jetflow.decoding.sampling import SamplingParams
from jetflow.errors import InvalidRequestError, JetFlowError
from jetflow.eval.bootstrap import speedup_interval
from jetflow.eval.datasets import NO_CATEGORY, EvalPrompt
from jetflow.eval.methods import MethodRunner, MethodSpec, reference_method
from jetflow.utils.fs import write_json_atomic

PHASES = ("draft", "tree", "verify", "accept", "commit")


@dataclass
class BenchSettings:
    target: str
    drafters: dict[str, str | None]  # attention kind -> checkpoint path
    max_new_tokens: int = 256
    temperature: float = 0.0
    seed: int = 0
    limit: int | None = None
    width: int = 7
    repeats: int = 1
    extra: dict = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)  # attention kind -> its checkpoint files' digests

    def key(self) -> dict:
        return dict(self.__dict__)

    @property
    def greedy(self) -> bool:
        """Whether the runs decode greedily (a temperature below SamplingParams' least does)."""
        return SamplingParams(self.temperature).greedy

    def run_key(self, spec: MethodSpec, dataset: str, budget: int | None, prompt_ids: list[str],
                prompt_file: str | None = None) -> dict:
        """What a run's numbers depend on: a stored run is reused only under the same key (so an ar
        run is shared by benchmarks of different drafters, a jetflow run is not). ``prompt_file``:
        the file a user's set came from (two files of one name are two sets)."""
        key = {k: v for k, v in self.key().items() if k not in ("drafters", "width", "digests")}
        key.update(dataset=dataset, method=spec.name, budget=budget, prompt_ids=prompt_ids)
        if prompt_file is not None:
            key["prompt_file"] = prompt_file
        kind = spec.head or ("native" if spec.name == "llama-dflash" else None)
        if kind is None:  # how heads draft says nothing about a run without one
            key["extra"] = {k: v for k, v in self.extra.items() if k not in ("draft_weights", "refine")}
        else:  # a checkpoint changed in place (calibrated, retrained, a new shipped head) is another drafter
            key["drafter"] = self.drafters.get(kind)
            key["drafter_digest"] = self.digests.get(kind)
        if spec.head is not None:  # (torch-jetflow decodes trees of this width too)
            key["width"] = self.width if spec.tree or spec.name == "torch-jetflow" else 1
        return key


def run_name(dataset: str, spec: MethodSpec, budget: int | None) -> str:
    return f"{dataset}__{spec.name}" + (f"__b{budget}" if budget is not None else "")


def run_prompts(runner: MethodRunner, spec: MethodSpec, prompts: list[EvalPrompt], budget: int | None,
                settings: BenchSettings, progress: bool = True) -> list[dict]:
    """One record per (prompt, turn); later turns are asked after the method's own answers."""
    bar = tqdm(prompts, desc=f"{spec.name}" + (f" b{budget}" if budget is not None else ""), unit="prompt",
               disable=not progress, leave=False)
    return [rec for prompt in bar for rec in prompt_records(runner, spec, prompt, budget, settings)]


def prompt_records(runner: MethodRunner, spec: MethodSpec, prompt: EvalPrompt, budget: int | None,
                   settings: BenchSettings) -> list[dict]:
    """The records of one prompt, one per turn."""
    records = []
    answers: list[str] = []
    for turn in range(len(prompt.turns)):
        request = prompt.request(answers)
        try:
            runs = [runner.run(spec, request, budget=budget, max_new_tokens=settings.max_new_tokens,
                               temperature=settings.temperature, seed=settings.seed, chat=prompt.chat)
                    for _ in range(settings.repeats)]
        except InvalidRequestError as e:  # say which prompt: a file may hold thousands
            raise JetFlowError(f"{prompt.where}, turn {turn + 1}: {e}") from None
        result = sorted(runs, key=lambda r: r.seconds)[(len(runs) - 1) // 2]  # the median repeat's own split
        stats = result.stats
        records.append({
            "id": prompt.id, "turn": turn, "prompt_tokens": result.prompt_tokens, "new_tokens": result.new_tokens,
            "seconds": statistics.median(r.seconds for r in runs),
            "seconds_all": [r.seconds for r in runs], "prefill_seconds": result.prefill_seconds,
            "rounds": stats.get("rounds", 0), "accept_lengths": stats.get("accept_lengths"),
            "time_split": stats.get("time_split"), "mean_tree_size": stats.get("mean_tree_size"),
            "round_kinds": stats.get("round_kinds"), "features": stats.get("features"),
            "finish_reason": result.finish_reason,
            "token_ids": result.token_ids, "category": prompt.category,
        })
        if settings.greedy and any(r.token_ids != result.token_ids for r in runs):
            records[-1]["repeats_differ"] = True  # greedy decoding gave other outputs on a later call
        answers.append(result.text)
    return records


def run_interleaved(runner: MethodRunner, runs: list[tuple[MethodSpec, int | None]], prompts: list[EvalPrompt],
                    settings: BenchSettings, progress: bool = True) -> list[list[dict]]:
    """The records of several runs, taken prompt by prompt: each prompt goes through every run
    before the next prompt, the order rotating by one each prompt, so a drift in the machine's speed
    (another process, clocks, memory placement) falls on every method alike instead of on whichever
    runs last. Returns the records per run, in the order of ``runs``."""
    records: list[list[dict]] = [[] for _ in runs]
    bar = tqdm(list(enumerate(prompts)), desc=f"{len(runs)} runs interleaved", unit="prompt",
               disable=not progress, leave=False)
    for i, prompt in bar:
        for j in [(i + k) % len(runs) for k in range(len(runs))]:
            spec, budget = runs[j]
            records[j] += prompt_records(runner, spec, prompt, budget, settings)
    return records


def run_side_by_side(runner, runs: list[tuple[MethodSpec, int | None]], prompts: list[EvalPrompt],
                     settings: BenchSettings, label: str) -> dict[str, dict]:
    """Warm every run up on the first prompt (one-time costs: allocations, the cost curve of
    `auto`), time them interleaved (:func:`run_interleaved`) and summarize each against the first
    run, which every greedy output must equal; prints a line per run. Returns {run name: {"summary",
    "records"}}, names as "method@budget"."""
    for spec, budget in runs:
        runner.run(spec, prompts[0].request([]), budget=budget, max_new_tokens=8,  # in the run's mode
                   temperature=settings.temperature, seed=settings.seed, chat=prompts[0].chat)
    records = run_interleaved(runner, runs, prompts, settings)
    rows = {}
    for (spec, budget), recs in zip(runs, records):
        name = spec.name + ("" if budget is None else f"@{budget}")
        s = summarize(recs, records[0], greedy=settings.greedy)
        # (the reference against itself: exactly 1; one prompt alone gives no interval)
        s["ci95"] = [1.0, 1.0] if recs is records[0] else s.get("speedup_ci95")
        rows[name] = {"summary": s, "records": recs}
        ci = f"[{s['ci95'][0]:.2f}-{s['ci95'][1]:.2f}]" if s["ci95"] else "[no interval: one prompt]"
        print(f"{label:8s} {name:34s} tau {s['tau']:5.2f}  {s['tokens_per_s']:6.2f} tok/s  "
              f"speed-up {s.get('speedup', 1.0):.2f}x {ci}  "
              f"outputs differing {len(s.get('mismatches', []))}")
    return rows


def compare_rows(a: dict, b: dict) -> dict:
    """Run ``a`` against run ``b`` of :func:`run_side_by_side`: the tokens/s ratio and its 95%
    interval from a paired bootstrap over prompts."""
    return {"ratio": a["summary"]["tokens_per_s"] / b["summary"]["tokens_per_s"],
            "ci95": speedup_interval(a["records"], b["records"])}


def print_comparison(label: str, a: dict, b: dict) -> dict:
    """:func:`compare_rows` of ``a`` against ``b``, printed as "label ratio [interval]" (one prompt
    gives no interval)."""
    c = compare_rows(a, b)
    print(f"{label} {c['ratio']:.2f}x" + (f" [{c['ci95'][0]:.2f}-{c['ci95'][1]:.2f}]" if c["ci95"] else ""))
    return c


def summarize(records: list[dict], reference: list[dict] | None, greedy: bool,
              equal_to: list[dict] | None = None, by_category: bool = True, as_text=None) -> dict:
    """Totals and means of one run; ``reference`` is the reference run on the same prompts (ar, or
    llama-ar in a greedy run on llama.cpp): the speed-up's denominator; ``equal_to`` the run whose outputs this one
    must reproduce (default: ``reference``), token for token, or with ``as_text`` (ids -> text) as
    text. Prompts with a category also get a summary per category."""
    tokens = sum(r["new_tokens"] for r in records)
    seconds = sum(r["seconds"] for r in records)
    rounds = sum(r["rounds"] for r in records)
    lengths = [a for r in records for a in (r["accept_lengths"] or [])]
    out = {"prompts": len({r["id"] for r in records}), "turns": len(records), "new_tokens": tokens,
           "seconds": seconds, "tokens_per_s": tokens / seconds if seconds else 0.0, "rounds": rounds,
           # output tokens per target forward after the prefill (its token is not from a round)
           "tokens_per_round": (tokens - len(records)) / rounds if rounds else 1.0}
    out["tau"] = out["tokens_per_round"]
    if lengths:  # the mean accepted length: a last round's tokens past a stop or the length limit count
        out["tau"] = sum(lengths) / len(lengths)
        out["accept_histogram"] = {str(k): v for k, v in sorted(Counter(lengths).items())}
        out["per_depth_acceptance"] = [sum(a - 1 >= d for a in lengths) / len(lengths)
                                       for d in range(1, max(lengths))]
    if without := sum(r.get("features") is False for r in records):  # turns served without the head (decoding/budget.py)
        out["turns_without_features"] = without
    sized = [r for r in records if r.get("mean_tree_size") is not None]
    if sized and rounds:  # draft nodes verified per round (the chosen budget under 'auto')
        out["mean_tree_size"] = sum(r["mean_tree_size"] * r["rounds"] for r in sized) / rounds
    splits = [r["time_split"] for r in records if r["time_split"]]
    if splits and rounds:
        ms = {p: sum(s[p] for s in splits) * 1e3 / rounds for p in PHASES}
        decode = sum(r["seconds"] - r["prefill_seconds"] for r in records) * 1e3 / rounds
        ms["other"] = max(0.0, decode - sum(ms.values()))
        out["ms_per_round"] = ms
    if reference is not None:
        ref = {(r["id"], r["turn"]): r for r in reference}
        ref_tps = sum(r["new_tokens"] for r in reference) / sum(r["seconds"] for r in reference)
        out["speedup"] = out["tokens_per_s"] / ref_tps  # headline: ratio of totals
        totals: dict = {}  # prompt id -> [tokens, seconds, reference tokens, reference seconds] over its turns
        for r in records:
            if (k := (r["id"], r["turn"])) in ref:
                t = totals.setdefault(r["id"], [0, 0.0, 0, 0.0])
                t[0], t[1] = t[0] + r["new_tokens"], t[1] + r["seconds"]
                t[2], t[3] = t[2] + ref[k]["new_tokens"], t[3] + ref[k]["seconds"]
        ratios = [(a / s) / (b / rs) for a, s, b, rs in totals.values() if s and rs and b]  # one per prompt
        out["speedup_per_prompt_mean"] = sum(ratios) / len(ratios) if ratios else None
        out["speedup_ci95"] = speedup_interval(records, reference)  # prompts resampled (eval/bootstrap.py)
    if greedy and (differ := [f"{r['id']}#{r['turn']}" for r in records if r.get("repeats_differ")]):
        out["repeats_differ"] = differ
    equal_to = reference if equal_to is None else equal_to
    if equal_to is not None and greedy:
        view = as_text or (lambda ids: ids)
        same = {(r["id"], r["turn"]): r for r in equal_to}
        out["mismatches"] = [f"{r['id']}#{r['turn']}" for r in records
                             if not _agree(same.get((r["id"], r["turn"])), r, view, as_text is not None)]
    categories = sorted({r["category"] for r in records if r.get("category")})
    if categories and any(not r.get("category") for r in records):
        categories.append(None)  # the prompts without one: "(none)" in the report
    if by_category and categories:
        def part(rows, cat):
            return None if rows is None else [r for r in rows if (r.get("category") or None) == cat]

        out["by_category"] = {cat or NO_CATEGORY: summarize(part(records, cat), part(reference, cat), greedy,
                                                         part(equal_to, cat), by_category=False, as_text=as_text)
                              for cat in categories}
    return out


def _agree(reference: dict | None, output: dict, view, as_text: bool) -> bool:
    """Whether records ``output`` and ``reference`` hold the same answer: token for token; as text,
    the one cut at the length limit may stop earlier (a re-tokenized text's ids cut at max_new_tokens
    cover less text than the ids it was printed from), but an answer that ended by itself must be
    all of the other's."""
    if reference is None:
        return False
    ref, out = view(reference["token_ids"]), view(output["token_ids"])
    if not as_text or ref == out:
        return ref == out
    if out.startswith(ref):
        return reference.get("finish_reason") == "length"
    return ref.startswith(out) and output.get("finish_reason") == "length"


def load_stored(path: Path, key: dict) -> dict | None:
    """The run stored at ``path`` if it was made with ``key`` (a damaged file counts as none)."""
    if path.is_file():
        try:
            stored = json.loads(path.read_text())
        except json.JSONDecodeError:
            return None
        if stored.get("key") == key:
            return stored
    return None


def report_mismatches(runs: list[dict], greedy: bool) -> int:
    """Print every output that differs from its reference (ar / llama-ar / torch-ar) under greedy
    decoding; returns how many."""
    if not greedy:
        return 0
    bad = 0
    for run in runs:
        if differ := run["summary"].get("repeats_differ"):  # (the reference's own runs too)
            bad += len(differ)
            print(f"NON-DETERMINISM: {run['method']} on {run['dataset']} gave other greedy outputs when a prompt "
                  f"was run again (--repeats), e.g. {differ[:3]}", file=sys.stderr)
        miss = run["summary"].get("mismatches") or []
        if miss:
            bad += len(miss)
            print(f"LOSSLESSNESS VIOLATION: {run['method']} on {run['dataset']}"
                  + (f" at budget {run['budget']}" if run["budget"] is not None else "")
                  + f": {len(miss)} output(s) differ from the reference, e.g. {miss[:3]}", file=sys.stderr)
    return bad


def stored_conflicts(plan: list[tuple[Path, dict]]) -> list[str]:
    """For each (run file, key) this benchmark would write: a line naming the file and the settings
    it was made with where a stored run there has other settings. Not conflicts: a damaged file, and
    a run that differs only in its prompts' content (an edited prompt file: the stored run describes
    prompts that no longer exist), or whose key predates ``prompt_file`` or the runtime's settings
    (timed again, as before they were part of the key)."""
    lines = []
    for path, key in plan:
        if not path.is_file():
            continue
        try:
            stored = json.loads(path.read_text()).get("key")
        except (json.JSONDecodeError, AttributeError):
            continue
        if not isinstance(stored, dict):
            continue
        if "runtime" in (key.get("extra") or {}) and "runtime" not in (stored.get("extra") or {}):
            continue  # made before the key named the runtime's settings
        differ = sorted(k for k in key.keys() | stored.keys() if k != "prompt_ids" and stored.get(k) != key.get(k)
                        and (k in stored or k != "prompt_file"))
        if differ:
            lines.append(f"{path.name}: " + ", ".join(f"{k} {stored.get(k)!r} (now {key.get(k)!r})" for k in differ[:3]))
    return lines


def run_benchmark(runner: MethodRunner, methods: list[MethodSpec], datasets: dict[str, list[EvalPrompt]],
                  budgets: list[int], settings: BenchSettings, out_dir: Path, progress: bool = True,
                  interleave: bool = True, overwrite: bool = False) -> list[dict]:
    """All runs (ar first on each dataset), each saved to ``out_dir/runs/NAME.json`` and summarized.
    ``interleave``: a dataset's runs that are not stored yet are timed prompt by prompt
    (:func:`run_interleaved`) and saved when the dataset ends; otherwise one run after another, each
    saved as it ends. A stored run made with other settings is not replaced unless ``overwrite``:
    JetFlowError (before anything runs) names them."""
    greedy = settings.greedy
    main_ref = reference_method(runner.target, greedy)  # a sampled run on llama.cpp: ar, not llama-ar
    if not overwrite:
        conflicts = stored_conflicts([
            (out_dir / "runs" / f"{run_name(dataset, spec, budget)}.json",
             settings.run_key(spec, dataset, budget, [p.id for p in prompts] + [prompts_digest(prompts)],
                              prompts[0].source))
            for dataset, prompts in datasets.items() for spec in methods
            for budget in (budgets if spec.tree else [None])])
        if conflicts:
            raise JetFlowError(f"{out_dir} holds {len(conflicts)} run(s) made with other settings, which this "
                               "benchmark would replace: " + "; ".join(conflicts[:4])
                               + ". Use another --out, or --overwrite to replace them.")
    check_prompts_fit(runner.target, datasets)
    (out_dir / "runs").mkdir(parents=True, exist_ok=True)
    warmed: set = set()

    def warm(spec, budget, prompts):
        # The first call pays one-time costs (allocations, kernels); `auto` also its cost curve and
        # budget state, made on its first request, so it is warmed apart from the fixed budgets.
        what = (spec.name, budget == "auto")
        if what not in warmed:
            runner.run(spec, prompts[0].request([]), budget=budget, max_new_tokens=8,  # in the run's mode
                       temperature=settings.temperature, seed=settings.seed, chat=prompts[0].chat)
            warmed.add(what)

    runs = []
    for dataset, prompts in datasets.items():
        plan = []  # (spec, budget, file, key, the run stored there under that key or None)
        for spec in methods:
            for budget in (budgets if spec.tree else [None]):
                key = settings.run_key(spec, dataset, budget, [p.id for p in prompts] + [prompts_digest(prompts)],
                                       prompts[0].source)
                path = out_dir / "runs" / f"{run_name(dataset, spec, budget)}.json"
                stored = load_stored(path, key)
                if stored is None and path.is_file():  # an edited prompt file's runs (or --overwrite): said, not silent
                    print(f"jetflow: note: {path} was made with other prompts or settings; it is measured again "
                          "and replaced", file=sys.stderr)
                plan.append((spec, budget, path, key, stored))
        fresh = {}
        pending = [(spec, budget) for spec, budget, _, _, stored in plan if stored is None]
        if interleave and len(pending) > 1:
            for spec, budget in pending:
                warm(spec, budget, prompts)
            for (spec, budget), records in zip(pending, run_interleaved(runner, pending, prompts, settings,
                                                                        progress)):
                fresh[(spec.name, budget)] = records
        refs: dict[str, list[dict]] = {}  # reference runs of this dataset by method name
        for spec, budget, path, key, run in plan:
            if run is None:
                records = fresh.get((spec.name, budget))
                if records is None:
                    warm(spec, budget, prompts)
                    records = run_prompts(runner, spec, prompts, budget, settings, progress)
                run = {"records": records, "key": key}
            if spec.name in (main_ref, spec.equals):
                refs[spec.name] = run["records"]
            as_text = None if spec.exact_tokens else (
                lambda ids: runner.target.tokenizer.decode(ids, skip_special_tokens=True))
            run.update(dataset=dataset, method=spec.name, budget=budget,
                       summary=summarize(run["records"], refs.get(main_ref), greedy,
                                         refs.get(spec.equals or main_ref), as_text=as_text))
            write_json_atomic(path, run)
            s = run["summary"]
            if progress:
                print(f"{dataset:10s} {spec.name:14s} {'' if budget is None else budget:>5} tau {s['tau']:5.2f} "
                      f"{s['tokens_per_s']:6.1f} tok/s  speed-up {s.get('speedup', 1):.2f}x"
                      + (f" (95% {ci[0]:.2f}-{ci[1]:.2f})" if (ci := s.get("speedup_ci95")) else ""), file=sys.stderr)
            runs.append(run)
    return runs


def check_prompts_fit(target, datasets: dict[str, list[EvalPrompt]]) -> None:
    """JetFlowError naming every prompt whose first turn does not fit the target's context, before
    anything runs: found at its turn, it would end a benchmark whose interleaved runs are saved only
    when their dataset ends. (A later turn grows with the answers; one that overflows names itself.)"""
    from jetflow.decoding.prompt import encode_prompt

    long = []
    for prompts in datasets.values():
        for p in prompts:
            try:
                n = len(encode_prompt(target.tokenizer, p.request([]), p.chat))
            except Exception as e:  # e.g. the chat template refuses the conversation (roles out of order)
                raise JetFlowError(f"{p.where}: the prompt cannot be encoded: {type(e).__name__}: {e}") from None
            if n >= target.max_context:
                long.append(f"{p.where}: {n} tokens")
    if long:
        raise JetFlowError(f"{len(long)} prompt(s) do not fit the model's context of {target.max_context} tokens: "
                           + "; ".join(long[:4]) + ("; ..." if len(long) > 4 else "")
                           + ". Remove them, or use a shorter --limit.")


def prompts_digest(prompts: list[EvalPrompt]) -> str:
    """A digest of the prompts' content: a stored run is not reused once a prompt file is edited."""
    h = hashlib.sha256()
    for p in prompts:
        h.update(json.dumps([p.id, p.turns, p.chat, p.history, p.category]).encode())
    return h.hexdigest()[:16]


def typical_context(runs: list[dict]) -> int:
    """Mean context length over the decoding steps of the ar runs (prompt + half the answer): the
    context at which the cost model measures forwards."""
    recs = [r for run in runs if run["method"] in ("ar", "llama-ar") for r in run["records"]]
    if not recs:
        return 256
    return max(1, round(sum(r.get("prompt_tokens", 0) + r["new_tokens"] / 2 for r in recs) / len(recs)))
