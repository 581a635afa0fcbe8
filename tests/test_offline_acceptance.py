"""Offline acceptance must equal what the decoding loop accepts, round by round."""

import copy

import pytest
import torch

import jetflow
from jetflow.data.shards import Sequence
from jetflow.errors import JetFlowError
from jetflow.eval.offline_acceptance import accepted_depth, offline_acceptance, path_nodes
from jetflow.models.checkpoint import new_head
from jetflow.models.draft_head import DraftHead, DraftHeadConfig
from jetflow.models.target import TargetModel
from jetflow.training.teacher import OnlineTeacher
from jetflow.training.trainer import TrainConfig, Trainer
from jetflow.tree.build import DraftTree
from test_tree_calibration import skewed_calibration
from tiny import tiny_model

PROMPTS = [[10, 20, 30, 40, 50], [7, 7, 8, 9], [100, 3, 5, 200, 11, 12]]


@pytest.fixture(scope="module")
def target(tokenizer):
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        model.model.norm.weight.mul_(4)  # peaked distributions: long accepted runs once trained
    return TargetModel(model, tokenizer, name="tiny", tapped_layers=[1, 2])


@pytest.fixture(scope="module")
def sequences(target):
    """The target's own greedy answers (what `jetflow regenerate` writes)."""
    return [Sequence(f"p{i}", p + jetflow.generate(target, p, max_new_tokens=60).token_ids, len(p))
            for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module", params=["causal", "bidirectional", "second-pass"])
def head(request, target, sequences, tmp_path_factory):
    """A head trained briefly on the sequences, so trees accept several tokens (a random head accepts ~0).
    "second-pass": a causal head that shifts tokens, trained with revealed blocks; decoding and the
    replay both run its path-conditioned second pass."""
    refine = dict(reveal=0.5, shift_tokens=True) if request.param == "second-pass" else {}
    config = TrainConfig(block_size=6, anchors_per_seq=16, layers=1, lr=1e-2, warmup_steps=5, epochs=40,
                         batch_size=3, eval_every=10_000, save_every=10_000, eval_sequences=0,
                         attention="bidirectional" if request.param == "bidirectional" else "causal",
                         draft_vocab=64, **refine)
    trainer = Trainer(target, sequences, tmp_path_factory.mktemp("run"), config)
    trainer.fit(log=lambda r: None)
    assert trainer.head.config.path_refine == bool(refine)
    return trainer.head.eval()


def test_path_nodes_and_budget_prefixes():
    tree = DraftTree.root_only(1)
    a = tree.add(5, 0, -0.1)  # node 1
    tree.add(6, 0, -0.5)  # node 2
    b = tree.add(7, a, -0.7)  # node 3
    tree.add(8, b, -0.9)  # node 4
    nodes = path_nodes(tree, [5, 7, 8, 9])
    assert nodes == [1, 3, 4]
    assert [accepted_depth(nodes, n) for n in (1, 2, 3, 4)] == [1, 1, 2, 3]
    assert path_nodes(tree, [6, 7]) == [2] and path_nodes(tree, [9]) == []


def decode_rounds(target, head, seq, budget, width, lookup=False, jf=None):
    """Accepted lengths of decoding ``seq``'s prompt (with ``jf``, a decoder kept across requests);
    the head drafts with its float weights, as the replay runs it."""
    jf = jf or jetflow.JetFlow(target, head, budget=budget, width=width, lookup=lookup, int8_draft=False)
    spec = jf.generate(seq.token_ids[:seq.prompt_len], max_new_tokens=len(seq.token_ids) - seq.prompt_len)
    assert spec.token_ids == seq.token_ids[seq.prompt_len:]  # the data is the target's greedy answer
    return spec.stats["accept_lengths"]


@pytest.mark.parametrize("budget, width", [(1, 7), (4, 2), (16, 7), (64, 7), (5, 1)])
def test_replayed_rounds_equal_the_decoding_loop(target, sequences, head, budget, width):
    teacher = OnlineTeacher(target, None)
    result = offline_acceptance(head, target, sequences, teacher, [0, 1, 2], [budget], width)
    replayed = result.depths[budget]
    decoded = []
    for seq in sequences:
        lengths = decode_rounds(target, head, seq, budget, width)
        # The data ends where decoding stopped: its last round may draft past it, the replay cannot.
        decoded += [n - 1 for n in lengths[:-1]] + [None]
    assert len(replayed) == len(decoded) and len(decoded) > 10
    for got, want in zip(replayed, decoded):
        assert want is None or got == want
    if width == 1:  # the chain column drafts the whole block, a chain of budget B-1
        assert result.depths["chain"] == offline_acceptance(head, target, sequences, teacher, [0, 1, 2],
                                                            [head.config.block_size - 1], 1, refine=False).depths[
            head.config.block_size - 1]


@pytest.mark.parametrize("head", ["second-pass"], indirect=True)
@pytest.mark.parametrize("budget", [4, 16])
def test_replayed_passes_equal_decoding_with_as_many(target, sequences, head, budget):
    """Three path-conditioned passes per round (each on the path the one before chose), replayed and
    decoded."""
    result = offline_acceptance(head, target, sequences, OnlineTeacher(target, None), [0, 1, 2], [budget], 7,
                                refine=3)
    decoded = []
    for seq in sequences:
        jf = jetflow.JetFlow(target, head, budget=budget, width=7, lookup=False, refine=3, int8_draft=False)
        decoded += [n - 1 for n in decode_rounds(target, head, seq, budget, 7, jf=jf)[:-1]] + [None]
    replayed = result.depths[budget]
    assert len(replayed) == len(decoded) and len(decoded) > 10
    assert all(want is None or got == want for got, want in zip(replayed, decoded))


@pytest.mark.parametrize("head", ["second-pass"], indirect=True)
@pytest.mark.parametrize("budget, refine, lookup", [(3, "tree", False), (16, "tree", False), (40, "tree:2", False),
                                                    (16, "tree", True)])
def test_replayed_tree_passes_equal_decoding_with_them(target, sequences, head, budget, refine, lookup):
    """The tree-conditioned pass (its slots are the nodes of each round's first tree, so its tree
    depends on the budget), replayed per round and budget, and decoded; with lookup merged in too."""
    result = offline_acceptance(head, target, sequences, OnlineTeacher(target, None), [0, 1, 2], [budget], 7,
                                refine=refine, lookup=lookup)
    decoded = []
    for seq in sequences:
        jf = jetflow.JetFlow(target, head, budget=budget, width=7, lookup=lookup, refine=refine, int8_draft=False)
        decoded += [n - 1 for n in decode_rounds(target, head, seq, budget, 7, jf=jf)[:-1]] + [None]
    replayed = result.depths[budget]
    assert len(replayed) == len(decoded) and len(decoded) > 10
    assert all(want is None or got == want for got, want in zip(replayed, decoded))
    if budget >= 16:  # the pass changed what was accepted (so the comparison covers it)
        plain = offline_acceptance(head, target, sequences, OnlineTeacher(target, None), [0, 1, 2], [budget], 7,
                                   refine=0, lookup=lookup)
        assert plain.depths[budget] != replayed


@pytest.mark.parametrize("budget, width", [(1, 7), (4, 2), (16, 7)])
def test_replayed_rounds_with_lookup_equal_the_decoding_loop(target, sequences, head, budget, width):
    """Head and lookup chain in one tree (the default decoder): the replay takes the same rounds,
    its lookup calibration learning as the decoder's does; each sequence is a fresh request."""
    teacher = OnlineTeacher(target, None)
    result = offline_acceptance(head, target, sequences, teacher, [0, 1, 2], [budget], width, lookup=True)
    assert result.summary()["lookup"] is True
    replayed, decoded = result.depths[budget], []
    for seq in sequences:
        lengths = decode_rounds(target, head, seq, budget, width, lookup=True)
        decoded += [n - 1 for n in lengths[:-1]] + [None]
    assert len(replayed) == len(decoded) and len(decoded) > 10
    assert all(want is None or got == want for got, want in zip(replayed, decoded))
    with pytest.raises(JetFlowError, match="lookup"):
        offline_acceptance(head, target, sequences, teacher, [0], [budget], width, anchors_per_seq=4, lookup=True)


def test_the_replay_prices_lookup_chains_per_request_as_decoding_does(target, sequences, head, monkeypatch):
    """Decoding prices chains with a RequestCalibration (each request's own counts shrunk towards
    the pooled ones); the replay makes one per sequence, over a fresh pool or the session's."""
    import jetflow.eval.offline_acceptance as replay
    from jetflow.decoding.drafter import make_drafter
    from jetflow.decoding.mixed_drafter import REQUEST_PRIOR, LookupCalibration, RequestCalibration

    made = []

    class Recording(RequestCalibration):
        def __init__(self, pooled, *a, **kw):
            super().__init__(pooled, *a, **kw)
            made.append(self)

    monkeypatch.setattr(replay, "RequestCalibration", Recording)
    teacher = OnlineTeacher(target, None)
    for session in (False, True):
        made.clear()
        offline_acceptance(head, target, sequences, teacher, [0, 1, 2], [4], 7, lookup=True, lookup_session=session)
        assert len(made) == 3 and all(c.strength == REQUEST_PRIOR and c.pooled.trials.sum() > 0 for c in made)
        assert (len({id(c.pooled) for c in made}) == 1) == session  # one pool carried over, or one per sequence
    decoder = make_drafter(head, target, lookup=True)  # what JetFlow decodes with
    assert isinstance(decoder.rates, RequestCalibration) and decoder.rates.strength == REQUEST_PRIOR
    assert isinstance(decoder.calibration, LookupCalibration)


@pytest.mark.parametrize("budget", [4, 16])
def test_lookup_session_replay_equals_one_decoder_answering_in_order(target, sequences, head, budget):
    """--lookup-session: the lookup counts carry over from one sequence to the next, as in one
    JetFlow object answering them in order."""
    teacher = OnlineTeacher(target, None)
    result = offline_acceptance(head, target, sequences, teacher, [0, 1, 2], [budget], 7, lookup=True,
                                lookup_session=True)
    jf = jetflow.JetFlow(target, head, budget=budget, width=7, lookup=True, int8_draft=False)
    decoded = []
    for seq in sequences:
        lengths = decode_rounds(target, head, seq, budget, 7, jf=jf)
        decoded += [n - 1 for n in lengths[:-1]] + [None]
    replayed = result.depths[budget]
    assert len(replayed) == len(decoded) and len(decoded) > 10
    assert all(want is None or got == want for got, want in zip(replayed, decoded))
    with pytest.raises(JetFlowError, match="needs lookup"):
        offline_acceptance(head, target, sequences, teacher, [0], [budget], 7, lookup_session=True)


@pytest.mark.parametrize("lookup", [False, True])
def test_calibrated_replay_equals_the_decoding_loop(target, sequences, head, lookup):
    """A head with a tree calibration: decoding and the replay both build its calibrated trees (and
    they differ from the uncalibrated ones, so neither side can be ignoring it)."""
    if head.config.path_refine:
        pytest.skip("the second pass's rows are not calibrated")
    calibrated = copy.deepcopy(head)
    calibrated.config.tree_calibration = skewed_calibration(head.config.block_size - 1, seed=3).to_json()
    teacher = OnlineTeacher(target, None)
    budget, width = 6, 3
    replayed = offline_acceptance(calibrated, target, sequences, teacher, [0, 1, 2], [budget], width, lookup=lookup)
    plain = offline_acceptance(calibrated, target, sequences, teacher, [0, 1, 2], [budget], width, lookup=lookup,
                               calibrated=False)
    assert plain.depths[budget] == offline_acceptance(head, target, sequences, teacher, [0, 1, 2], [budget], width,
                                                      lookup=lookup).depths[budget]
    assert replayed.depths[budget] != plain.depths[budget]
    decoded = []
    for seq in sequences:
        lengths = decode_rounds(target, calibrated, seq, budget, width, lookup=lookup)
        decoded += [n - 1 for n in lengths[:-1]] + [None]
    assert len(replayed.depths[budget]) == len(decoded)
    assert all(want is None or got == want for got, want in zip(replayed.depths[budget], decoded))


def test_lookup_replay_copies_what_the_answer_repeats(target):
    """An untrained head accepts nothing; merged with lookup, an answer that repeats its prompt is
    copied from it once the calibration has seen the chain accepted."""
    torch.manual_seed(0)
    head = DraftHead(DraftHeadConfig.for_target(target, block_size=6)).eval()
    text = list(range(40, 100))
    seqs = [Sequence("copy", text + text, len(text))]
    teacher = OnlineTeacher(target, None)
    merged = offline_acceptance(head, target, seqs, teacher, [0], [8], 7, lookup=True)
    alone = offline_acceptance(head, target, seqs, teacher, [0], [8], 7)
    assert alone.tau(8) == 1.0 and merged.tau(8) > 3.0


def test_lookup_session_carries_what_earlier_requests_taught(target):
    """Two requests that copy their prompts: in one session the second starts with the counts the
    first left, so it copies sooner than as a fresh request."""
    torch.manual_seed(0)
    head = DraftHead(DraftHeadConfig.for_target(target, block_size=6)).eval()
    text = list(range(40, 100))
    seqs = [Sequence("copy", text + text, len(text))] * 2
    teacher = OnlineTeacher(target, None)
    fresh = offline_acceptance(head, target, seqs, teacher, [0, 1], [16], 7, lookup=True).depths[16]
    session = offline_acceptance(head, target, seqs, teacher, [0, 1], [16], 7, lookup=True,
                                 lookup_session=True).depths[16]
    half = len(fresh) // 2  # fresh: both requests take the same rounds
    assert fresh[:half] == fresh[half:] and session[:half] == fresh[:half]
    assert len(session) < len(fresh)  # the second request copies its answer in fewer rounds


@pytest.mark.parametrize("budget, width", [(4, 2), (64, 7)])
def test_given_anchors_equal_the_decoding_loop(target, sequences, head, budget, width):
    """Fixed anchors (the uniform mode's path) agree with decoding at the rounds decoding made."""
    seq = sequences[1]
    lengths = decode_rounds(target, head, seq, budget, width)
    anchors = seq.prompt_len + torch.tensor([0] + lengths[:-1]).cumsum(0)
    result = offline_acceptance(head, target, sequences, OnlineTeacher(target, None), [1], [budget], width,
                                anchors={1: anchors[:-1]})
    assert result.depths[budget] == [n - 1 for n in lengths[:-1]]


def test_larger_budgets_never_accept_less(target, sequences, head):
    result = offline_acceptance(head, target, sequences, OnlineTeacher(target, None), [0, 1, 2],
                                [1, 4, 16, 64], width=7, anchors_per_seq=20)
    s = result.summary()
    assert s["mode"] == "uniform" and s["rounds"] == {"1": 60, "4": 60, "16": 60, "64": 60, "chain": 60}
    assert s["tau"]["1"] <= s["tau"]["4"] <= s["tau"]["16"] <= s["tau"]["64"]
    assert s["tau"]["64"] > 1.5  # the trained head gets whole runs accepted
    reached = s["depth_acceptance"]
    assert all(x >= y for x, y in zip(reached, reached[1:]))
    walk = offline_acceptance(head, target, sequences, OnlineTeacher(target, None), [0, 1, 2], [1, 64]).summary()
    assert walk["mode"] == "decode" and walk["rounds"]["1"] > walk["rounds"]["64"]  # more tokens per round


def test_refuses_eagle_heads_and_bad_budgets(target, sequences):
    cfg = DraftHeadConfig.for_target(target, block_size=4, kind="eagle3", num_hidden_layers=1)
    with pytest.raises(JetFlowError, match="block head"):
        offline_acceptance(new_head(cfg), target, sequences, OnlineTeacher(target, None), [0], [4])
    block = DraftHead(DraftHeadConfig.for_target(target, block_size=4))
    with pytest.raises(JetFlowError, match="budgets"):
        offline_acceptance(block, target, sequences, OnlineTeacher(target, None), [0], [0])
    block.config.path_refine = True  # a second pass through q slots (no --shift-tokens): decode it instead
    with pytest.raises(JetFlowError, match="shift-tokens"):
        offline_acceptance(block, target, sequences, OnlineTeacher(target, None), [0], [4])
    assert offline_acceptance(block, target, sequences, OnlineTeacher(target, None), [0], [4], refine=False).rounds


class _Interrupted(Exception):
    pass


class _CountingTeacher:
    """The online teacher, counting fetches; raises at fetch number ``fail_at`` (a replay killed mid-run)."""

    def __init__(self, target, fail_at=None):
        self.inner, self.fail_at, self.fetched = OnlineTeacher(target, None), fail_at, []

    def fetch(self, index, seq, anchors):
        if len(self.fetched) == self.fail_at:
            raise _Interrupted
        self.fetched.append(index)
        return self.inner.fetch(index, seq, anchors)


@pytest.mark.parametrize("mode", ["lookup-session", "uniform"])
def test_an_interrupted_replay_resumes_to_the_same_result(target, sequences, tmp_path, mode):
    """Killed after its first sequence, the replay started again reads that sequence from the journal
    (the lookup calibration it had left included), replays only the rest, and ends where a run
    without interruption does."""
    from jetflow.eval.replay_journal import ReplayJournal

    torch.manual_seed(0)
    head = DraftHead(DraftHeadConfig.for_target(target, block_size=6)).eval()
    text = list(range(40, 100))
    copies = [Sequence(f"copy{i}", text[i:] + text[i:], len(text) - i) for i in range(3)]
    seqs, kwargs = (copies, dict(lookup=True, lookup_session=True)) if mode == "lookup-session" else \
        (sequences, dict(anchors_per_seq=4, seed=3))
    run = dict(head=head, target=target, sequences=seqs, indices=[0, 1, 2], budgets=[4, 16], width=7, **kwargs)
    whole = offline_acceptance(teacher=_CountingTeacher(target), **run)
    settings = {"mode": mode}
    path = tmp_path / "replay.json.partial.jsonl"
    with pytest.raises(_Interrupted):
        offline_acceptance(teacher=_CountingTeacher(target, fail_at=1), journal=ReplayJournal(path, settings),
                           journal_key="h", **run)
    teacher = _CountingTeacher(target)
    resumed = offline_acceptance(teacher=teacher, journal=ReplayJournal(path, settings), journal_key="h", **run)
    assert teacher.fetched == [1, 2]  # the first sequence came from the journal
    assert resumed.depths == whole.depths and resumed.depth_reached == whole.depth_reached
    assert resumed.summary() == whole.summary()
    if mode == "lookup-session":  # the carried counts matter: a fresh calibration per sequence differs
        fresh = offline_acceptance(teacher=_CountingTeacher(target), **{**run, "lookup_session": False})
        assert fresh.depths != whole.depths


def test_a_journal_of_other_settings_or_a_damaged_one_is_refused_and_kept(tmp_path):
    from jetflow.eval.replay_journal import ReplayJournal

    path = tmp_path / "r.json.partial.jsonl"
    journal = ReplayJournal(path, {"width": 7, "budgets": [16]})
    journal.record("h", 0, {16: [3, 1], "chain": [2]}, 1.5)
    text = path.read_text()
    with pytest.raises(JetFlowError, match="width: 7.*now 24"):
        ReplayJournal(path, {"width": 24, "budgets": [16]})
    assert path.read_text() == text
    path.write_text(text + '{"drafter": "h", "ind')  # killed while writing a line: that sequence is redone
    again = ReplayJournal(path, {"width": 7, "budgets": [16]})
    assert again.done("h") == 1 and again.get("h", 0)["depths"] == {16: [3, 1], "chain": [2]}
    assert again.get("h", 1) is None and path.read_text() == text
    path.write_text(text.replace('"index": 0', '"index": "x"'))
    with pytest.raises(JetFlowError, match="line 2"):
        ReplayJournal(path, {"width": 7, "budgets": [16]})
    (tmp_path / "other.json").write_text('{"a": 1}\n')
    with pytest.raises(JetFlowError, match="not a replay journal"):
        ReplayJournal(tmp_path / "other.json", {})


def test_every_heads_replay_is_checked_before_any_replays(target, sequences, tmp_path, monkeypatch):
    """Several drafters: one that cannot be replayed (an EAGLE head) is refused by name before the
    others' replays run, not after an hour of them."""
    from jetflow.eval import offline_acceptance as oa
    from jetflow.models.eagle_head import EagleHead
    from jetflow.training import trainer as trainer_mod

    torch.manual_seed(0)
    block = DraftHead(DraftHeadConfig.for_target(target, block_size=5)).save_pretrained(tmp_path / "block")
    eagle = EagleHead(DraftHeadConfig.for_target(target, num_hidden_layers=1, block_size=4, kind="eagle3"))
    eagle = eagle.save_pretrained(tmp_path / "eagle")
    monkeypatch.setattr(trainer_mod, "load_sequences", lambda *a, **k: sequences)
    monkeypatch.setattr(oa, "offline_acceptance", lambda *a, **k: pytest.fail("a replay ran before the check"))
    with pytest.raises(JetFlowError, match="eagle: offline acceptance needs a block head"):
        oa.evaluate_drafters(target, [str(block), str(eagle)], tmp_path, budgets=[4])
