"""A sequence continued by another worker (KV handoff, or a resume after its worker died)
streams exactly the text of an undisturbed run, whatever token it is resumed at: also when
the first worker was holding back half a UTF-8 character or a possible stop-string prefix.
(The detokenizer of a continued sequence replays its generated tokens instead of treating
them as prompt.)"""

from __future__ import annotations

import pytest
from syshax.shared.sampling import SamplingParams
from syshax.workers.echo_engine import EchoEngine
from syshax.workers.engine.scheduler import Scheduler

TEXT = "river stone river garden é ü 日本語 river light ñandú 🙂 river music"


def run(engine: EchoEngine) -> list:
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


@pytest.mark.parametrize("stop", [[], ["river x"], ["日本x", "🙂 z"]])
def test_echo_resume_at_any_token_keeps_the_text(tokenizer, stop):
    ids = tokenizer.encode_chat([{"role": "user", "content": TEXT}])
    params = SamplingParams(max_tokens=48, temperature=0, stop=stop)
    engine = EchoEngine(tokenizer, max_model_len=4096)
    engine.add_request("r", ids, params)
    outs = run(engine)
    full = "".join(o.text for o in outs)
    assert "日本語" in full and "🙂" in full  # the prompt's multi-byte characters came out
    for k in range(1, len(outs)):
        resumed = EchoEngine(tokenizer, max_model_len=4096)
        resumed.resume_request("r", ids, [o.token_id for o in outs[:k]], params)
        text = "".join(o.text for o in outs[:k]) + "".join(o.text for o in run(resumed))
        assert text == full, f"resumed after {k} tokens"


def test_engine_detokenizer_of_a_continued_sequence_replays_its_tokens(tokenizer):
    """The scheduler under every engine (the real one too) primes a continued sequence's
    detokenizer the same way."""
    ids = tokenizer.encode(TEXT)
    params = SamplingParams(max_tokens=64, stop=["river x"])
    sched = Scheduler(max_num_seqs=1, max_model_len=4096, tokenizer=tokenizer)
    fresh = sched.new_sequence("a", [1, 2], params).detokenizer
    texts = [fresh.add(t) for t in ids]
    full = "".join(texts) + fresh.flush()
    for k in range(1, len(ids)):
        det = sched.new_sequence("a", [1, 2], params, output_ids=ids[:k]).detokenizer
        rest = "".join(det.add(t) for t in ids[k:]) + det.flush()
        assert "".join(texts[:k]) + rest == full, f"continued after {k} tokens"
