"""Faults never corrupt state (issue 10, the pipeline's part): every reproduction
is a test. A step is a transaction; one request's failure touches no other;
a failed or interrupted call leaves no queued, leaked or poisoned state."""

import pytest
import torch
from pipeline_helpers import assert_no_leaks, random_prompts

from servelab import Pipeline, SamplingParams
from servelab.samplers import Sampler

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# Over 32 tokens and sharing a prefix: full blocks that a poisoned cache would hand out.
SHARED = random_prompts([40], seed=21)[0]
PROMPTS = [SHARED + p[1:] for p in random_prompts([3, 9, 14], seed=22)] + [SHARED]


def _ids(outputs):
    return [o.token_ids for o in outputs]


@pytest.fixture(scope="module")
def fresh_outputs(tiny):
    return _ids(Pipeline.from_pretrained(tiny["llama"], block_size=4).generate(PROMPTS, GREEDY))


def _break_forward(pipe, exc_type, on_call: int, owner=None, method="forward"):
    """Make ``owner.method`` (default: the model's forward) raise ``exc_type``
    from call number ``on_call`` (0-based) on."""
    owner = pipe.model if owner is None else owner
    original, calls = getattr(owner, method), [0]

    def broken(*args, **kwargs):
        calls[0] += 1
        if calls[0] > on_call:
            raise exc_type("injected")
        return original(*args, **kwargs)

    setattr(owner, method, broken)


@pytest.mark.parametrize("where, on_call", [("model", 0), ("model", 3), ("sampler", 2)])
def test_interrupted_step_leaves_no_poisoned_cache(tiny, fresh_outputs, where, on_call):
    pipe = Pipeline.from_pretrained(tiny["llama"], block_size=4, enable_prefix_caching=True)
    owner = getattr(pipe, where)
    _break_forward(pipe, KeyboardInterrupt, on_call, owner)
    with pytest.raises(KeyboardInterrupt):
        pipe.generate(PROMPTS, GREEDY)
    del owner.forward
    assert_no_leaks(pipe)
    assert {o.finish_reason for o in pipe.last_outputs} == {"abort"}
    assert _ids(pipe.generate(PROMPTS, GREEDY)) == fresh_outputs
    assert_no_leaks(pipe)


def test_interrupted_step_driven_by_hand_is_rolled_back(tiny, fresh_outputs):
    """Ctrl-C inside step(): the requests go back to waiting and then finish as if nothing happened."""
    pipe = Pipeline.from_pretrained(tiny["llama"], block_size=4)
    rids = [pipe.add_request(p, GREEDY) for p in PROMPTS]
    pipe.step()
    _break_forward(pipe, KeyboardInterrupt, 0)
    with pytest.raises(KeyboardInterrupt):
        pipe.step()
    del pipe.model.forward
    assert not pipe.runner.requests or all(s.row < 0 for s in pipe.runner.requests.values())
    while pipe.has_unfinished_requests():
        pipe.step()
    assert [pipe.get_output(r, pop=True).token_ids for r in rids] == fresh_outputs
    assert_no_leaks(pipe)


def test_forward_exception_fails_that_steps_requests_and_the_engine_keeps_serving(tiny, fresh_outputs):
    pipe = Pipeline.from_pretrained(tiny["llama"], block_size=4)
    _break_forward(pipe, RuntimeError, 2)
    outs = pipe.generate(PROMPTS, GREEDY)
    assert {o.finish_reason for o in outs} == {"error"}
    assert all("RuntimeError: injected" in o.error for o in outs)
    m = pipe.last_run_metrics
    assert m.throughput_tok_s == 0 and m.request_throughput == 0 and m.num_errors == len(PROMPTS)
    assert "RuntimeError: injected" in m.table()
    del pipe.model.forward
    assert_no_leaks(pipe)
    assert _ids(pipe.generate(PROMPTS, GREEDY)) == fresh_outputs


@pytest.mark.parametrize("bad", [SamplingParams(temperature=0.0, max_tokens=4, logprobs=1000),
                                 SamplingParams(temperature=0.8, max_tokens=4, top_k=2 ** 40)])
def test_params_that_do_not_fit_the_model_fail_only_their_request(tiny, fresh_outputs, bad):
    pipe = Pipeline.from_pretrained(tiny["llama"], block_size=4)
    outs = pipe.generate(PROMPTS + [PROMPTS[0]], [GREEDY] * len(PROMPTS) + [bad])
    assert _ids(outs[:-1]) == fresh_outputs
    if bad.logprobs:
        assert outs[-1].finish_reason == "error" and "logprobs" in outs[-1].error
    else:  # a top_k past the vocabulary is clamped (keeps every token), never a crash of the batch
        assert outs[-1].finish_reason == "length" and len(outs[-1].token_ids) == 4
    assert_no_leaks(pipe)


class _RaisesFor:
    """A logits processor that raises for requests whose extra_args say so."""

    argmax_invariant = False

    def apply(self, logits, metadata):
        if any((p.extra_args or {}).get("boom") for p in metadata.params):
            raise ValueError("processor exploded")
        return logits


def test_a_raising_logits_processor_fails_only_its_request(tiny, fresh_outputs):
    pipe = Pipeline.from_pretrained(tiny["llama"], block_size=4, sampler=Sampler([_RaisesFor()]))
    boom = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, extra_args={"boom": True})
    outs = pipe.generate(PROMPTS + [PROMPTS[1]], [GREEDY] * len(PROMPTS) + [boom])
    assert _ids(outs[:-1]) == fresh_outputs
    assert outs[-1].finish_reason == "error" and "processor exploded" in outs[-1].error
    assert pipe.last_run_metrics.num_errors == 1
    assert_no_leaks(pipe)


class _MasksAll:
    """A logits processor that masks every token of requests whose extra_args say so."""

    argmax_invariant = False

    def apply(self, logits, metadata):
        rows = [i for i, p in enumerate(metadata.params) if (p.extra_args or {}).get("mask_all")]
        if not rows:
            return logits
        logits = logits.clone()
        logits[rows] = float("-inf")
        return logits


def test_a_row_the_sampler_cannot_sample_fails_only_its_request(tiny, fresh_outputs):
    """SamplerOutput.errors (every token masked) becomes that request's error, never a made-up token."""
    pipe = Pipeline.from_pretrained(tiny["llama"], block_size=4, sampler=Sampler([_MasksAll()]))
    masked = SamplingParams(temperature=0.7, max_tokens=12, extra_args={"mask_all": True})
    outs = pipe.generate(PROMPTS + [PROMPTS[2]], [GREEDY] * len(PROMPTS) + [masked])
    assert _ids(outs[:-1]) == fresh_outputs
    assert outs[-1].finish_reason == "error" and outs[-1].token_ids == [] and "sampling failed" in outs[-1].error
    assert_no_leaks(pipe)


class _Victimizer:
    """N-gram drafts, except for requests holding ``victim`` in their history: the
    drafter raises for them (mode "drafter") or drafts ``victim`` tokens, on which
    the verifier raises (mode "verifier")."""

    def __init__(self, victim, mode):
        from servelab.samplers.drafters import DraftProposal, get_drafter
        from servelab.samplers.verifiers import get_verifier

        self.victim, self.mode, self.name = victim, mode, "victimizer"
        self.ngram, self.rejection, self.proposal = get_drafter("ngram"), get_verifier("rejection"), DraftProposal

    def propose_for_requests(self, requests):
        hit = [self.victim in r.token_ids for r in requests]
        if any(hit) and self.mode == "drafter":
            raise RuntimeError("drafter exploded")
        plain = self.ngram.propose_for_requests(requests)
        return [self.proposal([self.victim] * r.k) if h else p for r, h, p in zip(requests, hit, plain)]

    def release(self, req_id):
        self.ngram.release(req_id)

    def verify(self, draft_token_ids, num_draft_tokens, target_probs, draft_probs, *, greedy, generators):
        if self.victim in draft_token_ids.tolist():
            raise RuntimeError("verifier exploded")
        return self.rejection.verify(draft_token_ids, num_draft_tokens, target_probs, draft_probs, greedy=greedy,
                                     generators=generators)


@pytest.mark.parametrize("where", ["verifier", "drafter"])
def test_a_raising_verifier_or_drafter_fails_only_its_request(tiny, where):
    victim = 511  # a token only the victim's prompt holds (the others draw below 500)
    prompts = random_prompts([8, 8, 8], seed=31, vocab_size=500)
    prompts[1] = prompts[1] + [victim]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = _ids(Pipeline.from_pretrained(tiny["llama"]).generate(prompts, params))
    both = _Victimizer(victim, where)
    pipe = Pipeline.from_pretrained(tiny["llama"], drafter=both, verifier=both, num_speculative_tokens=2)
    outs = pipe.generate(prompts, params)
    assert outs[1].finish_reason == "error" and f"{where} exploded" in outs[1].error
    assert [outs[0].token_ids, outs[2].token_ids] == [want[0], want[2]]
    assert_no_leaks(pipe)


def test_queueing_is_all_or_nothing(tiny):
    pipe = Pipeline.from_pretrained(tiny["llama"])
    mine = pipe.add_request([1, 2, 3], GREEDY, request_id="req-2")  # the id an automatic one would take
    outs = pipe.generate(PROMPTS, GREEDY)  # automatic ids skip ids in use: no collision, nothing orphaned
    assert [o.finish_reason for o in outs] == ["length"] * len(PROMPTS)
    assert len({o.request_id for o in outs} | {mine}) == len(PROMPTS) + 1
    assert pipe.get_output(mine, pop=True).finish_reason == "length"
    # an interrupt while queueing leaves none of the call's requests queued
    calls, add = [0], pipe.add_request

    def interrupted_add(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt
        return add(*args, **kwargs)

    pipe.add_request = interrupted_add
    with pytest.raises(KeyboardInterrupt):
        pipe.generate(PROMPTS, GREEDY)
    del pipe.add_request
    assert not pipe.has_unfinished_requests() and not pipe._tracked
    assert_no_leaks(pipe)


def test_bytes_are_not_prompts(tiny):
    pipe = Pipeline.from_pretrained(tiny["llama"])
    with pytest.raises(TypeError, match="bytes"):
        pipe.generate(b"The cache holds", GREEDY)
    outs = pipe.generate(["The cache", bytearray(b"\x01\x05"), torch.tensor([1, 5, 9])], GREEDY)
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert "bytearray" in outs[1].error
    assert not pipe.has_unfinished_requests()


def test_a_stop_string_is_a_stop_not_an_abort(tiny):
    pipe = Pipeline.from_pretrained(tiny["llama"])
    ref = pipe.generate(["On a quiet morning the baker"], GREEDY)[0]
    stop = ref.text[4:7]
    out = pipe.generate(["On a quiet morning the baker"],
                        SamplingParams(temperature=0.0, max_tokens=12, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert pipe.scheduler.num_aborted == 0
    assert pipe.last_run_metrics.finish_reasons == {"stop": 1}
    assert_no_leaks(pipe)


def test_tokenizer_less_pipeline_says_what_to_pass(tiny, tmp_path):
    import shutil

    for name in ("config.json", "generation_config.json", "model.safetensors"):  # a research checkpoint
        shutil.copy(tiny["llama"] / name, tmp_path / name)
    with pytest.warns(UserWarning, match="no tokenizer files"):
        pipe = Pipeline.from_pretrained(tmp_path)
    assert pipe.tokenizer is None
    out = pipe.generate(["hello"], GREEDY)[0]
    assert out.finish_reason == "error" and "no tokenizer" in out.error and "token ids" in out.error
    assert pipe.generate([[1, 5, 9]], GREEDY)[0].finish_reason == "length"


def test_speculation_on_but_nothing_proposed_is_said_so(tiny):
    pipe = Pipeline.from_pretrained(tiny["llama"], drafter="ngram", num_speculative_tokens=2)
    pipe.generate([[1, 7]], SamplingParams(temperature=0.0, max_tokens=1))
    m = pipe.last_run_metrics
    assert m.acceptance_rate is None and m.speculative
    assert "speculation on, nothing proposed" in m.table()
    plain = Pipeline.from_pretrained(tiny["llama"])
    plain.generate([[1, 7]], SamplingParams(temperature=0.0, max_tokens=1))
    assert "no speculative decoding" in plain.last_run_metrics.table()


def test_an_abort_interrupted_twice_still_ends_the_request_everywhere(tiny):
    """Found by the fault machine: the scheduler's abort raises, and its fallback (failing the request)
    is interrupted in the policy's end hook. The request must still end in the pipeline and the runner
    (no row left behind), and the Ctrl-C must come through."""
    pipe = Pipeline.from_pretrained(tiny["llama"], block_size=4)
    rid = pipe.add_request(PROMPTS[0], GREEDY)
    pipe.step()  # the runner now holds the request

    def broken_abort(request_id, *args, **kwargs):
        raise RuntimeError("injected")

    def interrupted_hook(request):
        raise KeyboardInterrupt("injected")

    pipe.scheduler.finish_request = broken_abort
    pipe.scheduler.policy.on_request_finished = interrupted_hook
    with pytest.raises(KeyboardInterrupt):
        pipe.abort_request(rid)
    del pipe.scheduler.finish_request, pipe.scheduler.policy.on_request_finished
    assert pipe.get_output(rid).finish_reason == "abort"
    assert rid not in pipe.runner.requests
    assert not pipe.scheduler.requests
    pipe.step()  # delivers the scheduler's pending final output; nothing comes back to life
    assert_no_leaks(pipe)
