"""The n-gram lookup's incremental haystack (ngram_lookup.Haystack): a sequence's ids appended
to step by step give the proposals a rebuild of every id gives, through accepted and rejected
drafts, cuts, replaced lists and preemption, and appending rebuilds nothing."""

from __future__ import annotations

import random
from array import array

from syshax.shared.sampling import SamplingParams
from syshax.workers.engine import ngram_lookup
from syshax.workers.engine.scheduler import Scheduler
from syshax.workers.engine.sequence import Sequence
from syshax.workers.engine.speculative import SpecConfig, SpecPolicy

TOKENS = [1, 2, 3, 256, 257, 65537, 7, 8]  # 256 and 65537 make byte patterns across two ids


def _same(hay: ngram_lookup.Haystack, ids: list[int], k: int, lo: int, hi: int) -> None:
    assert hay.buf == array("I", ids).tobytes() and len(hay) == len(ids)
    got = ngram_lookup.propose_in(hay, k, lo, hi)
    assert got == ngram_lookup.propose(ids, k, lo, hi), ids


def test_appended_ids_propose_what_a_rebuild_proposes():
    rng = random.Random(1)
    for _ in range(60):
        prompt = [rng.choice(TOKENS) for _ in range(rng.randint(0, 24))]
        output: list[int] = []
        hay = ngram_lookup.Haystack()
        for _ in range(40):
            output += [rng.choice(TOKENS) for _ in range(rng.randint(0, 4))]  # 0: a no-op step
            hay.sync(prompt, output)
            _same(hay, prompt + output, rng.randint(1, 5), 1, rng.randint(1, 6))
        assert hay.rebuilds == 1  # built once, appended to after


def test_cuts_changed_tokens_and_new_lists_are_followed():
    rng = random.Random(2)
    prompt = [rng.choice(TOKENS) for _ in range(20)]
    output: list[int] = []
    hay = ngram_lookup.Haystack()
    for _ in range(400):
        op = rng.random()
        if op < 0.15 and output:  # a rollback: the last ids cut off
            del output[rng.randint(0, len(output) - 1) :]
        elif op < 0.25 and output:  # the last id replaced in place (cut and regrown)
            output[-1] = rng.choice([t for t in TOKENS if t != output[-1]])
        elif op < 0.3:  # the sequence rebuilt (a handoff): other lists, the same ids
            prompt, output = list(prompt), list(output)
        elif op < 0.33:  # another prompt
            prompt = [rng.choice(TOKENS) for _ in range(rng.randint(1, 20))]
        else:
            output += [rng.choice(TOKENS) for _ in range(rng.randint(1, 4))]
        hay.sync(prompt, output)
        _same(hay, prompt + output, 3, 1, 5)


def test_the_policy_proposes_from_the_sequences_haystack_as_from_its_ids():
    """SpecPolicy.propose with a Sequence keeps seq.ngram_hay and settles the last draft as
    with the whole ids; the proposals equal those of a policy given the ids afresh."""
    rng = random.Random(3)
    inc = SpecPolicy(SpecConfig(method="ngram", num_tokens=4))
    ref = SpecPolicy(SpecConfig(method="ngram", num_tokens=4))
    for p in (inc, ref):
        for rows in range(1, 6):
            p.observe_step(rows, 0.1)  # flat: rows are free, k is the draft's length
    seq = Sequence("s", [rng.choice(TOKENS[:5]) for _ in range(30)], SamplingParams())
    twin = Sequence("t", list(seq.prompt_ids), SamplingParams())
    for _ in range(60):
        twin.ngram_hay = None  # the twin's ids are searched afresh each time
        a, b = inc.propose(None, 4, seq), ref.propose(None, 4, twin)
        assert a == b and len(seq.ngram_hay) == seq.length
        kept = a[: rng.randint(0, len(a))] + [rng.choice(TOKENS[:5])]  # accepted + target's
        seq.output_ids += kept
        twin.output_ids += kept
    assert seq.ngram_hay.rebuilds == 1
    assert sum(c[1] for c in inc.classes.counts.values()) > 20  # drafts were settled


def test_a_scheduled_sequence_with_rejections_and_preemption_proposes_as_a_rebuild():
    """Through the scheduler: drafts accepted in part or rejected, a preemption (the ids stay,
    the KV is recomputed): every draft is the one a fresh lookup over the ids gives."""
    rng = random.Random(4)
    cfg = SpecConfig(method="ngram", num_tokens=4)
    s = Scheduler(max_num_seqs=2, max_model_len=2048, max_num_batched_tokens=64, block_size=4,
                  speculation=cfg)  # fmt: skip
    for rows in range(1, 17):
        s.spec.observe_step(rows, 0.1)
    prompt = [rng.choice(TOKENS[:4]) for _ in range(40)]
    s.add(s.new_sequence("a", prompt, SamplingParams(temperature=0, max_tokens=1500)))
    step = s.schedule()
    s.update(step, [1], [None])
    seq = s.sequences["a"]
    checked = realigned = 0
    for n in range(120):
        if n in (30, 70):  # preempted: back to waiting, prefilled again from its ids
            s._preempt(seq)
            step = s.schedule()
            assert not any(c.draft for c in step.chunks)
            s.update(step, [rng.choice(TOKENS[:4])], [None])
            continue
        ids = list(seq.all_ids)
        step = s.schedule()
        (chunk,) = step.chunks
        want, _ = ngram_lookup.propose(ids, 4, cfg.ngram_min, cfg.ngram_max)
        if want or seq.ngram_draft is None or seq.ngram_draft.cls != ngram_lookup.REALIGNED:
            assert chunk.draft == want  # flat costs: every proposed token pays
        else:  # no suffix recurs: copied from the realigned position, read from the ids
            src = seq.ngram_cursor.src
            assert chunk.draft == ids[src : src + 4] and seq.ngram_cursor.at == len(ids)
            realigned += 1
        assert len(seq.ngram_hay) == len(ids)
        checked += bool(chunk.draft)
        keep = rng.randint(0, len(chunk.draft))  # drafts accepted, then the target's own
        tokens = chunk.draft[:keep] + [rng.choice(TOKENS[:4])]
        s.update(step, tokens, [None] * len(tokens), counts=[len(tokens)])
    assert checked > 40 and realigned > 0, (checked, realigned)
    assert seq.ngram_hay.rebuilds == 1
