import numpy as np
import pytest

from prime_rl.orchestrator.packing import balance_across_ranks, first_fit_decreasing, pack_batch
from prime_rl.orchestrator.rollout import Sample


def make_sample(prompt_len: int, completion_len: int, advantage: float, base: int = 100) -> Sample:
    prompt = list(range(base, base + prompt_len))
    completion = list(range(base + 1000, base + 1000 + completion_len))
    logprobs = [-(i + 1) / 100 for i in range(completion_len)]
    return Sample(prompt, completion, logprobs, advantage)


def unpack(mb):
    """Split a micro-batch back into samples using the position resets; returns [(ids, mask, adv, lp)]."""
    starts = [i for i in range(len(mb.position_ids)) if mb.position_ids[i] == 0]
    bounds = starts[1:] + [len(mb.position_ids)]
    return [
        (mb.input_ids[s:e], mb.loss_mask[s:e], mb.advantages[s:e], mb.inference_logprobs[s:e])
        for s, e in zip(starts, bounds)
        if mb.loss_mask[s:e].any()
    ]


def test_layout_positions_masks_and_nothing_lost():
    rng = np.random.default_rng(0)
    samples = [make_sample(int(rng.integers(2, 20)), int(rng.integers(1, 40)), float(i), base=i * 7) for i in range(23)]
    per_rank, stats = pack_batch(samples, seq_len=64, num_ranks=1)
    micro_batches = per_rank[0]
    for mb in micro_batches:
        assert mb.input_ids.shape == (64,) and mb.input_ids.dtype == np.int32
        assert mb.position_ids.dtype == np.int32 and mb.loss_mask.dtype == np.bool_
        assert mb.position_ids[0] == 0
        # positions count up by one inside a sample and restart at 0 at each sample start
        steps = np.diff(mb.position_ids)
        assert np.all((steps == 1) | (mb.position_ids[1:] == 0))
        assert not mb.loss_mask[mb.num_tokens :].any()  # padding never trains
    recovered = [piece for mb in micro_batches for piece in unpack(mb)]
    assert len(recovered) == len(samples) == stats.num_samples
    by_advantage = {float(adv[mask][0]): (ids, mask, lp) for ids, mask, adv, lp in recovered}
    for s in samples:
        ids, mask, lp = by_advantage[s.advantage]
        np.testing.assert_array_equal(ids, s.prompt_ids + s.completion_ids)
        np.testing.assert_array_equal(mask, [False] * len(s.prompt_ids) + [True] * len(s.completion_ids))
        np.testing.assert_allclose(lp[mask], s.completion_logprobs, rtol=1e-6)
        assert not lp[~mask].any()
    assert sum(mb.num_loss_tokens for mb in micro_batches) == sum(len(s.completion_ids) for s in samples)


def test_balanced_across_ranks():
    rng = np.random.default_rng(1)
    samples = [make_sample(int(rng.integers(4, 30)), int(rng.integers(1, 90)), 1.0) for _ in range(61)]
    per_rank, stats = pack_batch(samples, seq_len=128, num_ranks=4)
    counts = [len(mbs) for mbs in per_rank]
    assert len(set(counts)) == 1 and counts[0] >= 1
    tokens = [sum(mb.num_tokens for mb in mbs) for mbs in per_rank]
    assert sum(tokens) == sum(s.num_tokens for s in samples)
    assert max(tokens) - min(tokens) <= 128  # within one micro-batch's worth
    assert stats.num_micro_batches == sum(counts)


def test_pads_ranks_with_empty_zero_loss_micro_batches():
    samples = [make_sample(3, 4, 0.5) for _ in range(3)]  # 21 tokens: one micro-batch
    per_rank, stats = pack_batch(samples, seq_len=32, num_ranks=4)
    assert [len(mbs) for mbs in per_rank] == [1, 1, 1, 1]
    assert stats.num_padding_micro_batches == 3
    empties = [mbs[0] for mbs in per_rank if mbs[0].num_samples == 0]
    assert len(empties) == 3
    for mb in empties:
        assert not mb.loss_mask.any() and not mb.advantages.any()


def test_no_samples_still_gives_every_rank_a_micro_batch():
    per_rank, stats = pack_batch([], seq_len=16, num_ranks=2)
    assert [len(mbs) for mbs in per_rank] == [1, 1]
    assert stats.num_padding_micro_batches == 2


def test_overlong_samples_are_dropped_whole_never_cut_or_split():
    fits = make_sample(4, 4, 1.0)
    exact = make_sample(6, 10, 5.0)  # exactly seq_len: kept, alone in its micro-batch
    long_completion = make_sample(6, 50, 2.0)
    long_prompt = make_sample(20, 3, 3.0)
    empty = Sample([1, 2], [], [], 4.0)
    per_rank, stats = pack_batch([fits, long_completion, exact, long_prompt, empty], seq_len=16, num_ranks=1)
    assert stats.dropped_overlong == [1, 3] and stats.num_empty == 1
    assert stats.metrics(16)["batch/dropped_overlong"] == 2.0
    pieces = [p for mb in per_rank[0] for p in unpack(mb)]
    assert sorted(float(adv[mask][0]) for _, mask, adv, _ in pieces) == [1.0, 5.0]
    for ids, mask, _, _ in pieces:  # every kept sample whole, inside one micro-batch
        assert len(ids) in (8, 16) and mask.sum() in (4, 10)


def test_packing_never_splits_a_sample_across_micro_batches():
    rng = np.random.default_rng(2)
    samples = [make_sample(int(rng.integers(1, 30)), int(rng.integers(1, 40)), float(i)) for i in range(40)]
    per_rank, stats = pack_batch(samples, seq_len=48, num_ranks=2)
    kept = [s for i, s in enumerate(samples) if i not in stats.dropped_overlong]
    assert stats.dropped_overlong == [i for i, s in enumerate(samples) if s.num_tokens > 48]
    pieces = {float(adv[mask][0]): len(ids) for mbs in per_rank for mb in mbs for ids, mask, adv, _ in unpack(mb)}
    assert pieces == {s.advantage: s.num_tokens for s in kept}


def test_first_fit_decreasing_capacity():
    bins = first_fit_decreasing([5, 3, 8, 2, 7], capacity=10)
    assert sorted(i for b in bins for i in b) == [0, 1, 2, 3, 4]
    assert all(sum([5, 3, 8, 2, 7][i] for i in b) <= 10 for b in bins)
    assert len(bins) == 3
    with pytest.raises(ValueError, match="capacity"):
        first_fit_decreasing([11], capacity=10)


def test_balance_requires_even_split():
    assert sorted(map(len, balance_across_ranks([5, 1, 4, 2], 2))) == [2, 2]
    with pytest.raises(ValueError, match="pad first"):
        balance_across_ranks([1, 2, 3], 2)


def test_a_step_collects_its_groups_in_draw_order_not_completion_order():
    """Probe (issue 35): a resumed run's grad_norm differed by 1.2e-3 relative from the uninterrupted run's:
    groups were packed in the order they completed, which depends on timing, and the trainer's float sums
    follow the packing. Collected in draw order, the same groups always pack into the same rows."""
    import asyncio
    from types import SimpleNamespace

    from prime_rl.orchestrator.orchestrator import Orchestrator
    from prime_rl.orchestrator.rollout import Group

    completed = [Group({}, [1], [], [], 0, task_index=i) for i in (2, 0, 3, 1)]  # completion order

    async def get():
        return completed.pop(0)

    fake = SimpleNamespace(
        config=SimpleNamespace(groups_per_step=4),
        scheduler=SimpleNamespace(get=get),
        off_policy=SimpleNamespace(accept=lambda group, step: True),
    )
    groups = asyncio.run(Orchestrator.collect(fake, 1))
    assert [g.task_index for g in groups] == [0, 1, 2, 3]


def test_orchestrator_names_each_dropped_sample(caplog):
    """The orchestrator logs every overlong sample with its environment, task draw index and rollout."""
    from prime_rl.orchestrator.orchestrator import log_overlong
    from prime_rl.orchestrator.rollout import Completion, Group

    def group(env, index, lengths):
        completions = [Completion(list(range(n)), [-0.1] * n, "x") for n in lengths]
        return Group({"question": f"q{index}"}, [7, 7], completions, [0.0, 1.0], 0, env=env,
                     advantages=[-0.5, 0.5], task_index=index)  # fmt: skip

    groups = [group("short", 3, [4, 5]), group("long", 8, [6, 30])]
    samples = [s for g in groups for s in g.samples()]
    _, stats = pack_batch(samples, seq_len=16, num_ranks=1)
    assert stats.dropped_overlong == [3]
    with caplog.at_level("WARNING", logger="prime_rl.orchestrator.orchestrator"):
        log_overlong(groups, samples, stats.dropped_overlong, 16)
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert "env long, task #8, rollout 1 of 2: 32 tokens (prompt 2 + completion 30) > seq_len=16" in message
    assert '"question": "q8"' in message


def test_routed_experts_sit_beside_their_tokens_with_minus_one_elsewhere():
    """vLLM reports one row per token but a sample's last (never forwarded): packed at the sample's start, -1 on
    its last token and on padding; a row without any sample carrying experts sends none."""
    a, b = make_sample(3, 4, 1.0), make_sample(2, 3, -1.0, base=50)
    a.routed_experts = np.full((6, 2, 2), 5, dtype=np.uint8)
    b.routed_experts = np.full((4, 2, 2), 7, dtype=np.uint8)
    (micro_batches,), _ = pack_batch([a, b], seq_len=16, num_ranks=1)
    (mb,) = micro_batches
    experts = mb.fields()["routed_experts"]
    assert experts.shape == (16, 2, 2) and experts.dtype == np.int16
    np.testing.assert_array_equal(experts[:6], 5)
    assert (experts[6] == -1).all()  # a's last token
    np.testing.assert_array_equal(experts[7:11], 7)
    assert (experts[11:] == -1).all()  # b's last token, then padding
    (bare,), _ = pack_batch([make_sample(3, 4, 1.0)], seq_len=16, num_ranks=1)
    assert "routed_experts" not in bare[0].fields()
