"""infra/engine.py: the in-process Hugging Face engine (the reference rollout engine) against
independent references: top-p against a numpy computation, the sampler's log-probs against a
float64 recomputation of the model's, the Rollout's mask and padding, seeds per prompt, and a
payload merged as sync.EngineWeights merges it. vLLM's engine: test_vllm_engine.py."""

import numpy as np
import torch

import sync
from infra import wire
from infra.engine import HFEngine, top_p_filter
from tiny import VOCAB, tiny_qwen2

EOS, PAD = 2, 0


def engine(seed=0):
    return HFEngine(tiny_qwen2(dtype=torch.bfloat16, seed=seed), base_seed=5, sketch_rank=4, eos=EOS, pad=PAD)


def test_top_p_keeps_the_smallest_set_that_reaches_p():
    logits = torch.tensor([[2.0, 0.5, 1.0, -1.0, 0.0], [0.1, -0.3, 0.2, 0.0, 3.0]])  # no ties: one order
    for top_p in (0.3, 0.6, 0.9, 0.999):
        kept = torch.isfinite(top_p_filter(logits.clone(), top_p)).numpy()
        for row, keep in zip(logits.numpy(), kept):
            p = np.exp(row - row.max())
            p /= p.sum()
            order = np.argsort(-p)
            before = np.cumsum(p[order]) - p[order]  # the mass of the tokens ranked above each
            expect = np.zeros(len(p), dtype=bool)
            expect[order[before < top_p]] = True
            assert (keep == expect).all(), (top_p, row, keep, expect)


def test_rollout_logprobs_mask_and_padding():
    eng = engine()
    prompts = [[1, 5, 6, 7], [1, 9, 8, 3]]
    ro = eng.generate(prompts, [11, 12], temperature=0.7, max_new_tokens=6)
    assert ro.ids.shape[0] == 2 and torch.equal(ro.ids[:, :4], torch.tensor(prompts))
    with torch.no_grad():  # float64 reference: log softmax(z / T) at each sampled token
        logits = eng.model(input_ids=ro.ids).logits.double() / 0.7
    for b in range(2):
        ended = False
        for t in range(4, ro.ids.shape[1]):
            token = int(ro.ids[b, t])
            if ended:  # after EOS: padding, neither scored nor in the mask
                assert token == PAD and not ro.mask[b, t] and ro.logprobs[b, t] == 0
                continue
            ref = torch.log_softmax(logits[b, t - 1], -1)[token].item()
            assert ro.mask[b, t] and abs(ro.logprobs[b, t].item() - ref) < 0.05, (b, t)
            ended = token == EOS
        assert bool(ro.eos[b]) == ended
        assert ro.responses[b] == [i for i in ro.ids[b, 4:].tolist() if i != PAD]


def test_each_prompt_draws_from_its_own_seed():
    eng = engine()
    a = eng.generate([[1, 5, 6, 7]] * 3, [3, 3, 4], temperature=1.0, max_new_tokens=8)
    b = eng.generate([[1, 5, 6, 7]] * 3, [3, 3, 4], temperature=1.0, max_new_tokens=8)
    assert torch.equal(a.ids, b.ids) and torch.equal(a.logprobs, b.logprobs)  # the same seeds: the same
    assert torch.equal(a.ids[0], a.ids[1])  # a prompt's sample depends on its seed, not its place
    assert not torch.equal(a.ids[0], a.ids[2])  # another seed, another sample (8 tokens of 96)


def test_a_payload_merges_as_the_engine_weights_do():
    eng, ref = engine(), sync.EngineWeights(tiny_qwen2(dtype=torch.bfloat16), base_seed=5, rank=4)
    g = torch.Generator().manual_seed(0)
    factors = {name: torch.randn(slot.param.shape[0], 4, generator=g).to(torch.bfloat16)
               for name, slot in ref.slots.items()}
    sent = eng.apply(sync.Payload(0, 5, 4, factors))
    ref.apply(sync.Payload(0, 5, 4, factors))
    assert sent == wire.encode(sync.Payload(0, 5, 4, factors)).numel() > 0
    assert eng.fingerprint() == ref.fingerprint() and eng.weights.update == 1
    assert VOCAB == eng.model.config.vocab_size


def test_a_padded_rollout_is_the_same_rollout_longer():
    ro = engine().generate([[1, 5, 6, 7], [1, 9, 8, 3]], [11, 12], temperature=1.0, max_new_tokens=5)
    t = ro.ids.shape[1]
    longer = ro.padded(t + 3, EOS)
    assert longer.ids.shape == (2, t + 3) and torch.equal(longer.ids[:, :t], ro.ids)
    assert (longer.ids[:, t:] == EOS).all()
    assert torch.equal(longer.mask[:, :t], ro.mask) and not longer.mask[:, t:].any()
    assert torch.equal(longer.logprobs[:, :t], ro.logprobs) and (longer.logprobs[:, t:] == 0).all()
    assert longer.responses == ro.responses and torch.equal(longer.eos, ro.eos) and ro.padded(t, EOS) is ro
    try:
        ro.padded(t - 1, EOS)
    except ValueError as e:
        assert "cannot be padded" in str(e)
    else:
        raise AssertionError("a shorter length was accepted")


class _EvenFirst:
    """A held-out task for evaluate: a response is right when its first token is even."""

    def __init__(self, n):
        self.heldout = [(i, [1, 5 + i % 7, 6, 7]) for i in range(n)]

    @staticmethod
    def prompt_ids(problems):
        return [p[1] for p in problems]

    @staticmethod
    def correct(problem, response):
        return bool(response) and response[0] % 2 == 0

    @staticmethod
    def question(problem):
        return f"problem {problem[0]}"

    @staticmethod
    def decode(response):
        return " ".join(map(str, response))


def test_the_evaluation_counts_scores_tokens_and_shows_its_first_responses():
    """engine.evaluate against a numpy recomputation from the same samples (the engine's own
    generate, each sample's documented seed): pass@1, pass@k, pass@1's standard error over
    problems, the generated tokens a response, and the first sample of the first SHOWN
    problems as text with its score."""
    from infra.engine import SHOWN, evaluate, stable_seed

    eng, task, k = engine(), _EvenFirst(11), 3
    got = evaluate(eng, task, samples=k, temperature=1.0, top_p=1.0, max_new_tokens=5, seed=4, world=1, rank=0,
                   device="cpu")
    right, lengths, first = np.zeros((11, k)), [], []
    for s in range(k):
        ro = eng.generate(task.prompt_ids(task.heldout), [stable_seed("eval", 4, i, s) for i in range(11)],
                          temperature=1.0, max_new_tokens=5)
        right[:, s] = [task.correct(p, y) for p, y in zip(task.heldout, ro.responses)]
        lengths += [len(y) for y in ro.responses]
        first = first or ro.responses
    means = right.mean(1)
    assert got["pass1"] == right.mean() and got["passk"] == right.max(1).mean()
    assert abs(got["pass1_se"] - means.std(ddof=1) / np.sqrt(11)) < 1e-6  # the means of k scores in float32
    assert got["eval_tokens_mean"] == np.mean(lengths) and 1 <= np.mean(lengths) <= 5
    assert got["eval_texts"] == [{"question": f"problem {i}", "response": " ".join(map(str, first[i])),
                                  "score": float(right[i, 0])} for i in range(SHOWN)]
    assert (got["eval_problems"], got["eval_samples"]) == (11, k) and 0 < right.mean() < 1  # both grades occur


def test_the_kv_cache_generates_what_the_whole_sequence_does():
    """kv_cache=True (train.py's on GPUs): the same noise and so, in fp32, the same tokens and
    log-probs within 1e-5 as running the whole sequence again for every token; in bf16 (the
    engine's) the same tokens here, log-probs within bf16's rounding of other kernels' sums."""
    prompts, seeds = [[1, 5, 6, 7, 8, 9, 3]] * 6, list(range(6))
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        rollouts = []
        for cached in (False, True):
            e = HFEngine(tiny_qwen2(dtype=torch.bfloat16, seed=3), base_seed=5, sketch_rank=4, eos=EOS, pad=PAD,
                         exact=False, kv_cache=cached)
            e.model.load_state_dict(tiny_qwen2(dtype=torch.float32, seed=3).state_dict())  # fp32 values, cast
            e.model.to(dtype)
            rollouts.append(e.generate(prompts, seeds, temperature=1.0, max_new_tokens=12))
        plain, cached = rollouts
        assert torch.equal(plain.ids, cached.ids) and torch.equal(plain.mask, cached.mask), dtype
        assert plain.mask.sum() > 6 * 2  # responses of several tokens: the cache was used
        assert (plain.logprobs - cached.logprobs).abs().max() <= tolerance, dtype
