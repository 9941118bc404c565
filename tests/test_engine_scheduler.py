"""Unit tests of the engine's bookkeeping: page allocator, state slots, scheduler, budgets."""
from __future__ import annotations

import contextlib

import pytest

from pipeline.engine.block_manager import BlockManager
from pipeline.engine.config import EngineConfig
from pipeline.engine.scheduler import Scheduler
from pipeline.engine.sequence import Sequence, Status
from pipeline.engine.state_slots import StateSlots
from pipeline.errors import UserError
from pipeline.models.base import DeltaStateSpec, ModelSpec


def seq(i, n, new=0):
    return Sequence(i, list(range(n)), max_new_tokens=new)


def test_block_manager_reserves_whole_sequences_and_frees_them():
    bm = BlockManager(num_pages=10, page_size=16)
    a, b = seq(0, 33), seq(1, 16, new=5)       # 3 pages; 16 + 4 fed-back tokens -> 2 pages
    bm.allocate(a)
    bm.allocate(b)
    assert len(a.pages) == 3 and len(b.pages) == 2 and bm.num_free == 5
    assert not set(a.pages) & set(b.pages)
    bm.check()
    bm.free(a)
    assert a.pages == [] and bm.num_free == 8
    bm.check()
    assert not bm.can_allocate(seq(2, 16 * 9))
    assert bm.can_allocate(seq(3, 16 * 8))


def test_block_manager_refuses_double_allocation_and_foreign_frees():
    bm = BlockManager(num_pages=4, page_size=16)
    a = seq(0, 10)
    bm.allocate(a)
    with pytest.raises(AssertionError):
        bm.allocate(a)
    impostor = seq(7, 10)
    impostor.pages = list(a.pages)
    with pytest.raises(AssertionError):
        bm.free(impostor)


def test_state_slots_hand_out_distinct_slots_and_take_them_back():
    slots = StateSlots(2)
    a, b, c = seq(0, 4), seq(1, 4), seq(2, 4)
    slots.allocate(a)
    slots.allocate(b)
    assert {a.slot, b.slot} == {0, 1} and slots.num_free == 0
    with pytest.raises(AssertionError):
        slots.allocate(c)
    slots.free(a)
    slots.allocate(c)
    assert c.slot == 0 and a.slot == -1


def make_scheduler(budget, max_seqs, causal=True, pages=64, slots=4):
    return Scheduler(budget, max_seqs, causal, BlockManager(pages, 16), StateSlots(slots) if slots else None)


def run_all(s: Scheduler):
    steps = []
    while s.has_work():
        step = s.schedule()
        steps.append([(x.seq.seq_id, x.start, x.num_tokens) for x in step])
        assert sum(n for _, _, n in steps[-1]) <= s.max_tokens or len(step) == 1
        assert len(step) <= s.max_seqs
        s.after_step(step)
    return steps


def test_causal_prefill_is_chunked_under_the_token_budget():
    s = make_scheduler(budget=10, max_seqs=4)
    seqs = [seq(0, 25), seq(1, 3), seq(2, 4)]
    for x in seqs:
        s.add(x)
    steps = run_all(s)
    assert steps[0] == [(0, 0, 10)]
    assert steps[1] == [(0, 10, 10)]
    assert steps[2] == [(0, 20, 5), (1, 0, 3), (2, 0, 2)]       # the last one starts as a chunk of 2
    assert steps[3] == [(2, 2, 2)]
    assert all(x.status == Status.FINISHED and x.pages == [] and x.slot == -1 for x in seqs)
    s.blocks.check()
    assert s.blocks.num_free == 64 and s.slots.num_free == 4


@pytest.mark.parametrize("budget", [64, 100, 256, 1000])
def test_batch_invariant_prefill_is_cut_only_at_multiples_of_the_split_unit(budget):
    """split_unit 64 (batch-invariant runs): a sequence continued in a later step is cut only at multiples
    of 64 tokens whatever the budget; sequences that fit whole run whole; every step makes progress."""
    s = Scheduler(budget, 4, True, BlockManager(512, 16), StateSlots(4), split_unit=64)
    lengths = [300, 5, 130, 64, 65, 1]
    seqs = [seq(i, n) for i, n in enumerate(lengths)]
    for x in seqs:
        s.add(x)
    cuts = {i: [] for i in range(len(seqs))}
    for step in run_all(s):
        assert step, "a step with nothing scheduled"
        for i, start, n in step:
            assert start % 64 == 0, (i, start)
            cuts[i].append(start + n)
    for i, n in enumerate(lengths):
        assert cuts[i][-1] == n and all(c % 64 == 0 for c in cuts[i][:-1]), (i, cuts[i])
    assert all(x.status == Status.FINISHED for x in seqs)


def test_encoder_sequences_run_whole_and_alone_when_over_budget():
    s = make_scheduler(budget=10, max_seqs=4, causal=False, slots=0)
    for i, n in enumerate((25, 6, 6, 3)):
        s.add(seq(i, n))
    steps = run_all(s)
    assert steps == [[(0, 0, 25)], [(1, 0, 6)], [(2, 0, 6), (3, 0, 3)]]


def test_chunked_sequences_wait_for_a_state_slot():
    s = make_scheduler(budget=4, max_seqs=4, slots=1)
    s.add(seq(0, 6))
    s.add(seq(1, 6))
    first = s.schedule()
    assert [(x.seq.seq_id, x.num_tokens) for x in first] == [(0, 4)]   # seq 1 would need the only slot
    s.after_step(first)
    second = s.schedule()
    assert [(x.seq.seq_id, x.num_tokens) for x in second] == [(0, 2)]
    s.after_step(second)
    assert [(x.seq.seq_id, x.num_tokens) for x in s.schedule()] == [(1, 4)]


def test_decodes_are_scheduled_before_prefill_and_running_is_capped():
    s = make_scheduler(budget=8, max_seqs=2, slots=4)
    a, b, c = seq(0, 3, new=4), seq(1, 20, new=4), seq(2, 2, new=4)
    for x in (a, b, c):
        s.add(x)
    step = s.schedule()
    assert [(x.seq.seq_id, x.num_tokens) for x in step] == [(0, 3), (1, 5)]
    s.after_step(step)
    a.append(7)                                    # a's first new token: now it decodes
    step = s.schedule()
    assert [(x.seq.seq_id, x.num_tokens) for x in step] == [(0, 1), (1, 7)]
    assert c.status == Status.WAITING              # max_seqs running already
    s.after_step(step)
    s.finish(a, "stop")
    step = s.schedule()
    assert [(x.seq.seq_id, x.start, x.num_tokens) for x in step] == [(1, 12, 8)]  # b takes the whole budget; c waits
    s.after_step(step)
    s.abort_all()
    s.blocks.check()
    assert s.blocks.num_free == 64 and s.slots.num_free == 4


SPEC = ModelSpec(architecture="t", hidden_size=8, num_layers=2, vocab_size=32, is_causal=True,
                 num_attention_layers=1, num_kv_heads=2, head_dim=16, max_tokens=None,
                 delta=DeltaStateSpec(1, 64, 3, 2, 16, 16))


def test_budgets_are_validated_up_front():
    import torch
    cpu, f32 = torch.device("cpu"), torch.float32
    ok = EngineConfig(max_tokens_per_step=64, max_seqs=8, max_model_len=1000).resolve(SPEC, cpu, f32)
    assert ok.num_pages * ok.page_size >= 1000 + 64 and ok.num_state_slots >= 1
    with pytest.raises(UserError, match="fewer than one maximum-length sequence"):
        EngineConfig(max_tokens_per_step=64, max_seqs=8, max_model_len=1000, num_pages=50).resolve(SPEC, cpu, f32)
    with pytest.raises(UserError, match="generated"):
        EngineConfig(max_tokens_per_step=64, max_seqs=8, max_model_len=1000, max_new_tokens=100,
                     num_pages=63).resolve(SPEC, cpu, f32)
    with pytest.raises(UserError, match="power of two"):
        EngineConfig(max_tokens_per_step=64, max_seqs=8, max_model_len=10, page_size=24).resolve(SPEC, cpu, f32)
    gen = EngineConfig(max_tokens_per_step=4, max_seqs=8, max_model_len=100, max_new_tokens=10).resolve(SPEC, cpu, f32)
    assert gen.num_state_slots == 4     # never more running sequences than can decode in one step


def test_caches_past_the_ram_are_refused_on_cpu():
    """`--max-tokens-per-batch 99999999999` on CPU sized a KV cache of 24,000 GiB, which the worker allocated
    and zeroed until the kernel's OOM killer ended it a minute later (exit "killed by SIGKILL"); refused at
    once, as on a GPU, naming the sizes and the options."""
    import torch
    cpu, f32 = torch.device("cpu"), torch.float32
    try:
        with open("/proc/meminfo") as f:
            free = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        pytest.skip("the kernel says nothing of its available memory here")
    huge = EngineConfig(max_tokens_per_step=99_999_999_999, max_seqs=8, max_model_len=1000)
    with pytest.raises(UserError, match=r"the engine's caches need [\d.]+ [KMGT]B but only [\d.]+ [KMGT]B of memory "
                                        r"\(RAM\) is free .*lower --max-tokens-per-batch to \d+ \(or less\), or --max-seqs"):
        huge.resolve(SPEC, cpu, f32)
    fits = EngineConfig(max_tokens_per_step=64, max_seqs=8, max_model_len=1000).resolve(SPEC, cpu, f32)
    assert fits.cache_bytes(SPEC, f32, cpu) < free


def test_a_refused_cache_names_the_largest_budget_that_fits(monkeypatch):
    """The refusal names the --max-tokens-per-batch with which the caches fit (a multiple of the invariant
    split: the largest), so the worker can print a command that continues the run; where even the longest
    sequence alone does not fit, or the cache's size was given, no budget is named and --max-length is."""
    import torch

    from pipeline.engine.config import INVARIANT_SPLIT, SUGGESTED_SHARE, CachesTooLarge
    cpu, f32 = torch.device("cpu"), torch.float32
    monkeypatch.setenv("RUN_SHARDS_FAULT_FREE_RAM", str(64 * 2**20))
    allowed = 0.9 * 64 * 2**20
    config = lambda budget, **k: EngineConfig(max_tokens_per_step=budget, max_seqs=8, max_model_len=1000, **k)  # noqa: E731

    @contextlib.contextmanager
    def less_memory():   # what a refusal's settings are sized for: 5% less than it saw (SUGGESTED_SHARE)
        monkeypatch.setenv("RUN_SHARDS_FAULT_FREE_RAM", str(int(SUGGESTED_SHARE * 64 * 2**20)))
        yield
        monkeypatch.setenv("RUN_SHARDS_FAULT_FREE_RAM", str(64 * 2**20))

    with pytest.raises(CachesTooLarge, match=r"only 67\.1 MB of memory \(RAM\)") as refused:
        config(10_000_000).resolve(SPEC, cpu, f32)
    budget = refused.value.fitting_budget
    assert budget is not None and budget % INVARIANT_SPLIT == 0
    assert f"--max-tokens-per-batch to {budget} " in str(refused.value)
    # the largest that fits with 5% less memory than the refusal saw: free memory moves between two commands
    assert config(budget).resolve(SPEC, cpu, f32).cache_bytes(SPEC, f32, cpu) <= SUGGESTED_SHARE * allowed
    with less_memory(), pytest.raises(CachesTooLarge):
        config(budget + INVARIANT_SPLIT).resolve(SPEC, cpu, f32)
    # two CPU workers of one machine: each takes at most its half (two caches of `budget` overfilled the RAM)
    with pytest.raises(CachesTooLarge, match="shared by the run's 2 workers") as refused:
        config(budget, memory_shared_by=2).resolve(SPEC, cpu, f32)
    half = refused.value.fitting_budget
    assert half < budget and config(half).resolve(SPEC, cpu, f32).cache_bytes(SPEC, f32, cpu) <= SUGGESTED_SHARE * allowed / 2
    config(half, memory_shared_by=2).resolve(SPEC, cpu, f32)

    # the longest prompt alone too much: the largest --max-length with which the caches fit (another run), with
    # the smallest budget where the run's budget leaves room for none
    with pytest.raises(CachesTooLarge, match=r"lower --max-length to \d+ \(or less\)\.?$") as refused:
        EngineConfig(max_tokens_per_step=4096, max_seqs=8, max_model_len=50_000_000).resolve(SPEC, cpu, f32)
    assert refused.value.fitting_budget is None and list(refused.value.change) == ["max_length"]
    length = refused.value.change["max_length"]
    with less_memory():
        EngineConfig(max_tokens_per_step=4096, max_seqs=8, max_model_len=length).resolve(SPEC, cpu, f32)
        with pytest.raises(CachesTooLarge):
            EngineConfig(max_tokens_per_step=4096, max_seqs=8, max_model_len=length + 1).resolve(SPEC, cpu, f32)
    step_too = dict(max_tokens_per_step=int(allowed / SPEC.kv_bytes_per_token(f32, False)), max_seqs=8)
    with pytest.raises(CachesTooLarge, match=r"lower --max-tokens-per-batch to 64 and --max-length to \d+ ") as refused:
        EngineConfig(max_model_len=50_000_000, **step_too).resolve(SPEC, cpu, f32)
    assert list(refused.value.change) == ["max_tokens_per_batch", "max_length"]
    EngineConfig(max_tokens_per_step=64, max_seqs=8, max_model_len=refused.value.change["max_length"]).resolve(
        SPEC, cpu, f32)
    # where not even SHORTEST_NAMED_LENGTH tokens would fit, no setting is named
    monkeypatch.setenv("RUN_SHARDS_FAULT_FREE_RAM", "1000")
    with pytest.raises(CachesTooLarge, match="lower --max-length, --max-tokens-per-batch or --max-seqs$") as refused:
        EngineConfig(max_tokens_per_step=4096, max_seqs=8, max_model_len=1000).resolve(SPEC, cpu, f32)
    assert refused.value.change is None
    monkeypatch.setenv("RUN_SHARDS_FAULT_FREE_RAM", str(64 * 2**20))
    # generating, each running sequence's cache holds its --max-new-tokens: where no budget or --max-seqs
    # brings it within the memory, the refusal names the largest --max-new-tokens that does
    with pytest.raises(CachesTooLarge, match=r"lower --max-new-tokens to \d+ \(or less\), or --max-length$") as refused:
        config(64, max_new_tokens=10**9).resolve(SPEC, cpu, f32)
    assert refused.value.fitting_budget is None and list(refused.value.change) == ["max_new_tokens"]
    new_tokens = refused.value.change["max_new_tokens"]
    with less_memory():
        config(64, max_new_tokens=new_tokens).resolve(SPEC, cpu, f32)
        with pytest.raises(CachesTooLarge):
            config(64, max_new_tokens=new_tokens + 1).resolve(SPEC, cpu, f32)
    # else the largest --max-seqs (the budget alone cannot help), else both: the run goes on, computing the same
    seqs_only = dict(max_seqs=256, max_model_len=64, max_new_tokens=20_000)
    with pytest.raises(CachesTooLarge, match=r"lower --max-seqs to \d+ \(or less\), or --max-new-tokens$") as refused:
        EngineConfig(max_tokens_per_step=64, **seqs_only).resolve(SPEC, cpu, f32)
    seqs = refused.value.change["max_seqs"]
    assert list(refused.value.change) == ["max_seqs"] and 1 <= seqs < 256
    with less_memory():
        EngineConfig(max_tokens_per_step=64, **dict(seqs_only, max_seqs=seqs)).resolve(SPEC, cpu, f32)
        with pytest.raises(CachesTooLarge):
            EngineConfig(max_tokens_per_step=64, **dict(seqs_only, max_seqs=seqs + 1)).resolve(SPEC, cpu, f32)
    with pytest.raises(CachesTooLarge, match=r"lower --max-tokens-per-batch to 64 and --max-seqs to \d+ ") as refused:
        EngineConfig(max_tokens_per_step=500_000, **seqs_only).resolve(SPEC, cpu, f32)
    assert refused.value.change == {"max_tokens_per_batch": 64, "max_seqs": seqs}
    assert refused.value.fitting_budget is None
    # and where neither --max-new-tokens at the run's steps nor any --max-length fits, --max-new-tokens with the
    # smallest steps (a red team's finding: no setting was named, and the smaller step the message suggested was
    # refused again before the next message named a --max-new-tokens)
    too_many = dict(max_seqs=256, max_model_len=64, max_new_tokens=10**9)
    with pytest.raises(CachesTooLarge, match=r"lower --max-tokens-per-batch to 64 and --max-new-tokens to \d+ "
                                             r"\(or less\), or --max-length$") as refused:
        EngineConfig(max_tokens_per_step=500_000, **too_many).resolve(SPEC, cpu, f32)
    change = refused.value.change
    assert list(change) == ["max_tokens_per_batch", "max_new_tokens"]
    with pytest.raises(CachesTooLarge):   # (at the run's own step, no --max-new-tokens fits)
        EngineConfig(max_tokens_per_step=500_000, **dict(too_many, max_new_tokens=1)).resolve(SPEC, cpu, f32)
    fitting = dict(max_tokens_per_step=64, max_seqs=256, max_model_len=64)
    with less_memory():
        EngineConfig(max_new_tokens=change["max_new_tokens"], **fitting).resolve(SPEC, cpu, f32)
        with pytest.raises(CachesTooLarge):
            EngineConfig(max_new_tokens=change["max_new_tokens"] + 1, **fitting).resolve(SPEC, cpu, f32)
    with pytest.raises(CachesTooLarge) as refused:
        config(10_000_000, num_pages=10_000_000).resolve(SPEC, cpu, f32)
    assert refused.value.fitting_budget is None


def test_a_max_length_is_named_where_only_fewer_sequences_per_step_leave_room_for_one(monkeypatch):
    """Each --max-seqs holds a page of slack in the KV cache: the default 256 took 4,096 tokens, and a memory with
    room for a 64-token step and a few thousand tokens of the longest record but not for that slack had its
    refusal name no command ("lower --max-length, --max-tokens-per-batch or --max-seqs"), though a run with as
    many sequences per step as the step has tokens (no step runs more) fits a --max-length of some 1,400 tokens.
    The refusal names that run: the budget, --max-seqs and the largest --max-length with them."""
    import torch

    from pipeline.engine.config import INVARIANT_SPLIT, SUGGESTED_SHARE, CachesTooLarge
    cpu, f32 = torch.device("cpu"), torch.float32
    pages = 160   # the cache the memory holds: 160 pages of 16 tokens (260 for the slack of 256 sequences alone)
    ram = int(pages * 16 * SPEC.kv_bytes_per_token(f32, False) / 0.9) + 1
    monkeypatch.setenv("RUN_SHARDS_FAULT_FREE_RAM", str(ram))

    @contextlib.contextmanager
    def less_memory():   # what a refusal's settings are sized for: 5% less than it saw (SUGGESTED_SHARE)
        monkeypatch.setenv("RUN_SHARDS_FAULT_FREE_RAM", str(int(SUGGESTED_SHARE * ram)))
        yield
        monkeypatch.setenv("RUN_SHARDS_FAULT_FREE_RAM", str(ram))
    with pytest.raises(CachesTooLarge, match=r"lower --max-tokens-per-batch to 64, --max-seqs to 64 and --max-length "
                                             r"to \d+ \(or less\)$") as refused:
        EngineConfig(max_tokens_per_step=4096, max_seqs=256, max_model_len=50_000).resolve(SPEC, cpu, f32)
    change = refused.value.change
    assert list(change) == ["max_tokens_per_batch", "max_seqs", "max_length"], change
    assert change["max_tokens_per_batch"] == change["max_seqs"] == INVARIANT_SPLIT
    length = change["max_length"]
    assert 1000 < length < (pages - 64 // 16 - 64) * 16   # (what the step and its slack leave, less the rest)
    with less_memory():
        EngineConfig(max_tokens_per_step=64, max_seqs=64, max_model_len=length).resolve(SPEC, cpu, f32)
        with pytest.raises(CachesTooLarge):
            EngineConfig(max_tokens_per_step=64, max_seqs=64, max_model_len=length + 1).resolve(SPEC, cpu, f32)
    # a budget already that small: --max-seqs and --max-length alone
    with pytest.raises(CachesTooLarge) as refused:
        EngineConfig(max_tokens_per_step=64, max_seqs=256, max_model_len=50_000).resolve(SPEC, cpu, f32)
    assert refused.value.change == {"max_seqs": 64, "max_length": length}
    # generating, each running sequence holds its new tokens too: --max-seqs halved until a --max-length fits
    generating = dict(max_seqs=256, max_model_len=50_000, max_new_tokens=40)
    with pytest.raises(CachesTooLarge) as refused:
        EngineConfig(max_tokens_per_step=4096, **generating).resolve(SPEC, cpu, f32)
    change = refused.value.change
    assert list(change) == ["max_tokens_per_batch", "max_seqs", "max_length"] and change["max_seqs"] < 64, change
    fitting = dict(generating, max_seqs=change["max_seqs"], max_model_len=change["max_length"])
    with less_memory():
        with pytest.raises(CachesTooLarge):   # (twice the sequences: not even the shortest length named)
            EngineConfig(max_tokens_per_step=64, **dict(generating, max_seqs=2 * change["max_seqs"], max_model_len=64)
                         ).resolve(SPEC, cpu, f32)
        EngineConfig(max_tokens_per_step=64, **fitting).resolve(SPEC, cpu, f32)
        with pytest.raises(CachesTooLarge):
            EngineConfig(max_tokens_per_step=64, **dict(fitting, max_model_len=change["max_length"] + 1)).resolve(
                SPEC, cpu, f32)


def test_block_tables_stay_equal_to_a_rebuild_after_random_admits_and_finishes():
    """blocks.tables is written once per admission and cleared at finish (rows reused, the table grown in
    rows and width as needed); after every admit or finish, each admitted sequence's gathered block
    table equals the one built from scratch from its pages, zero-padded to the widest."""
    import random

    import numpy as np
    rng = random.Random(5)
    bm = BlockManager(num_pages=400, page_size=16)
    live, next_id = [], 0
    for _ in range(600):
        if live and (rng.random() < 0.45 or bm.num_free < 40):
            bm.free(live.pop(rng.randrange(len(live))))
        else:
            seq = Sequence(next_id, [1] * rng.randint(1, 300), max_new_tokens=rng.choice([0, 1, 40]))
            next_id += 1
            if bm.can_allocate(seq):
                bm.allocate(seq)
                live.append(seq)
        bm.check()
        if live:
            step = rng.sample(live, rng.randint(1, len(live)))
            width = max(len(s.pages) for s in step)
            rebuilt = np.zeros((len(step), width), np.int32)
            for i, s in enumerate(step):
                rebuilt[i, :len(s.pages)] = s.pages
            np.testing.assert_array_equal(bm.block_tables(np.array([s.row for s in step])), rebuilt)
    assert next_id > 100 and bm.tables.shape[0] >= 16 and bm.tables.shape[1] >= 19
