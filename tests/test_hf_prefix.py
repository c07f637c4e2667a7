"""vkattn.hf prefix cache across generate() calls: a chat that resends its history computes only
the new turn, and generates what eager attention generates from scratch. Seeded tiny random-weight
Llama (no download); needs the hf extra (torch, transformers), skipped where it is absent."""
import numpy as np
import pytest
from conftest import HF_SKIP, TRANSFORMERS_MIN

torch = pytest.importorskip("torch", reason="the hf extra is not installed (make setup-hf)")
transformers = pytest.importorskip("transformers", minversion=TRANSFORMERS_MIN, reason=HF_SKIP)

import vkattn.hf                                                # noqa: E402
from vkattn.errors import CacheFullError                        # noqa: E402
from vkattn.hf import BLOCK_SIZE, VkattnCache                   # noqa: E402

from test_hf import VOCAB, assert_same, generate, model_for     # noqa: E402


@pytest.fixture
def prefilled(monkeypatch):
    """The number of positions each generate()'s first forward computed (layer 0's first update)."""
    calls = []
    real = vkattn.hf.VkattnLayer.update

    def update(self, key_states, value_states, *args, **kwargs):
        if self is self._owner.layers[0]:
            calls.append(key_states.shape[2])
        return real(self, key_states, value_states, *args, **kwargs)

    monkeypatch.setattr(vkattn.hf.VkattnLayer, "update", update)
    return calls


def ids_of(seed, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (1, n), generator=g)


def test_chat_resending_its_history_prefills_only_the_new_turn(prefilled):
    model = model_for("llama")
    cache = VkattnCache(model.config, 128, dtype="float32", prefix_cache=True)
    turn1 = ids_of(1, 21)
    assert cache.match_prefix(turn1) == 0
    out1 = generate(model, "vkattn", turn1, cache=cache, max_new_tokens=12)
    assert_same(out1, generate(model, "eager", turn1, max_new_tokens=12))
    assert prefilled == [21] + [1] * 11
    cache.record_tokens(out1.sequences)           # the reply's ids: its blocks become reusable too

    # the history (prompt + reply: 33 tokens, 32 of them in the cache) and a new user turn
    turn2 = torch.cat([out1.sequences, ids_of(2, 9)], dim=1)
    assert cache.match_prefix(turn2) == 32        # 2 full blocks of 16
    assert cache.get_seq_length() == 32
    prefilled.clear()
    out2 = generate(model, "vkattn", turn2, cache=cache, max_new_tokens=12)
    assert prefilled[0] == turn2.shape[1] - 32    # the new turn (and the last reply token) only
    assert_same(out2, generate(model, "eager", turn2, max_new_tokens=12))

    # a third turn: the whole second exchange is reused
    cache.record_tokens(out2.sequences)
    turn3 = torch.cat([out2.sequences, ids_of(3, 5)], dim=1)
    kept = cache.match_prefix(turn3)
    assert kept == (out2.sequences.shape[1] - 1) // BLOCK_SIZE * BLOCK_SIZE == 48
    assert_same(generate(model, "vkattn", turn3, cache=cache, max_new_tokens=6),
                generate(model, "eager", turn3, max_new_tokens=6))
    cache.close()


def test_without_record_tokens_nothing_is_reused():
    """The cache registers ids only from record_tokens (what generate() ran), never from
    match_prefix's input_ids: a generate() given other ids than match_prefix cannot poison it."""
    model = model_for("llama")
    cache = VkattnCache(model.config, 96, dtype="float32", prefix_cache=True)
    turn1 = ids_of(4, 21)
    cache.match_prefix(turn1)
    out1 = generate(model, "vkattn", turn1, cache=cache, max_new_tokens=12)
    turn2 = torch.cat([out1.sequences, ids_of(5, 4)], dim=1)
    assert cache.match_prefix(turn2) == 0
    assert_same(generate(model, "vkattn", turn2, cache=cache, max_new_tokens=8),
                generate(model, "eager", turn2, max_new_tokens=8))
    cache.close()


def test_an_edited_history_reuses_only_what_still_matches():
    model = model_for("llama")
    cache = VkattnCache(model.config, 96, dtype="float32", prefix_cache=True)
    turn1 = ids_of(6, 40)
    cache.match_prefix(turn1)
    out1 = generate(model, "vkattn", turn1, cache=cache, max_new_tokens=4)
    cache.record_tokens(out1.sequences)
    edited = out1.sequences.clone()
    edited[0, 20] = (edited[0, 20] + 1 - 3) % (VOCAB - 3) + 3  # a token in block 1 changed
    assert cache.match_prefix(edited) == 16
    assert_same(generate(model, "vkattn", edited, cache=cache, max_new_tokens=6),
                generate(model, "eager", edited, max_new_tokens=6))
    cache.close()


def test_two_conversations_share_a_system_prompt_and_keep_their_histories():
    model = model_for("llama")
    cache = VkattnCache(model.config, 64, dtype="float32", prefix_cache=True, prefix_cache_len=64)
    system = ids_of(7, 20)
    a = torch.cat([system, ids_of(8, 15)], dim=1)
    b = torch.cat([system, ids_of(9, 15)], dim=1)
    assert cache.match_prefix(a) == 0
    out_a = generate(model, "vkattn", a, cache=cache, max_new_tokens=4)
    cache.record_tokens(out_a.sequences)
    assert cache.match_prefix(b) == 16            # the system prompt's full block
    out_b = generate(model, "vkattn", b, cache=cache, max_new_tokens=4)
    cache.record_tokens(out_b.sequences)
    a2 = torch.cat([out_a.sequences, ids_of(10, 3)], dim=1)
    assert cache.match_prefix(a2) == 32           # conversation a's blocks survived b
    assert_same(generate(model, "vkattn", a2, cache=cache, max_new_tokens=5),
                generate(model, "eager", a2, max_new_tokens=5))
    cache.close()


def test_batch_rows_keep_the_shortest_match():
    model = model_for("llama")
    cache = VkattnCache(model.config, 80, batch_size=2, dtype="float32", prefix_cache=True)
    rows = torch.cat([ids_of(11, 36), ids_of(12, 36)])
    assert cache.match_prefix(rows) == 0
    out = generate(model, "vkattn", rows, cache=cache, max_new_tokens=3)
    cache.record_tokens(out.sequences)
    nxt = torch.cat([out.sequences[:, :36], ids_of(13, 4).repeat(2, 1)], dim=1)
    nxt[1, 20] = (nxt[1, 20] + 1 - 3) % (VOCAB - 3) + 3   # row 1 shares only its first block
    assert cache.match_prefix(nxt) == 16
    assert_same(generate(model, "vkattn", nxt, cache=cache, max_new_tokens=4),
                generate(model, "eager", nxt, max_new_tokens=4))
    cache.close()


def test_rejects_and_changes_nothing():
    model = model_for("llama")
    plain = VkattnCache(model.config, 32, dtype="float32")
    with pytest.raises(ValueError, match="prefix_cache: match_prefix needs a cache built with"):
        plain.match_prefix(ids_of(1, 5))
    with pytest.raises(ValueError, match="prefix_cache_len: room for cached blocks needs prefix_cache=True"):
        VkattnCache(model.config, 32, prefix_cache_len=16)
    with pytest.raises(TypeError, match="prefix_cache: expected a bool"):
        VkattnCache(model.config, 32, prefix_cache=1)
    cache = VkattnCache(model.config, 48, dtype="float32", prefix_cache=True)
    turn = ids_of(14, 20)
    cache.match_prefix(turn)
    cache.record_tokens(generate(model, "vkattn", turn, cache=cache, max_new_tokens=4).sequences)
    turn = torch.cat([turn, ids_of(15, 7)], dim=1)             # 27: the first 16 are reused
    assert cache.match_prefix(turn) == 16
    out = generate(model, "vkattn", turn, cache=cache, max_new_tokens=2)
    seen = cache.get_seq_length()
    assert seen == 28

    def state():
        return seen, [layer._store.pool.token_ids(layer._store.ids[0]) for layer in cache.layers]

    before = state()
    assert before[1] == [turn[0, :16].tolist()] * 2
    wrong = out.sequences.clone()
    wrong[0, 3] += 1
    calls = [
        (lambda: cache.match_prefix(ids_of(1, 49)), CacheFullError, "input_ids: 49 positions > max_cache_len=48"),
        (lambda: cache.match_prefix(torch.cat([turn, turn])), ValueError, "input_ids: 2 rows, but the cache was built"),
        (lambda: cache.match_prefix(turn.float()), TypeError, "input_ids\\[0\\]: expected integer token ids"),
        (lambda: cache.match_prefix(torch.zeros((1, 0), dtype=torch.long)), ValueError,
         "input_ids: expected token ids of shape"),
        (lambda: cache.match_prefix(-turn), ValueError, "input_ids\\[0\\]: expected token ids in"),
        (lambda: cache.record_tokens(out.sequences[:, :seen - 1]), ValueError, "sequences: expected \\(1, >= 28\\)"),
        (lambda: cache.record_tokens(wrong), ValueError,
         f"sequences\\[0, 3\\]: the cache computed token id {int(turn[0, 3])} there, got {int(turn[0, 3]) + 1}"),
    ]
    for call, exc, msg in calls:
        with pytest.raises(exc, match=msg):
            call()
        assert (cache.get_seq_length(), state()[1]) == before
    cache.record_tokens(out.sequences)
    assert state()[1] == [out.sequences[0, :seen].tolist()] * 2
    plain.close()
    cache.close()


def test_a_loaded_chat_is_reused(tmp_path):
    """VkattnCache.load with saved token ids records them: the next turn reuses the loaded history."""
    model = model_for("llama")
    cache = VkattnCache(model.config, 96, dtype="float32", prefix_cache=True)
    turn1 = ids_of(21, 30)
    cache.match_prefix(turn1)
    out1 = generate(model, "vkattn", turn1, cache=cache, max_new_tokens=6)
    cache.save(tmp_path / "chat.safetensors", token_ids=out1.sequences[:, :cache.get_seq_length()])
    cache.close()
    other = VkattnCache(model.config, 96, dtype="float32", prefix_cache=True)
    other.load(tmp_path / "chat.safetensors")
    turn2 = torch.cat([out1.sequences, ids_of(22, 4)], dim=1)
    assert other.match_prefix(turn2) == 32
    assert_same(generate(model, "vkattn", turn2, cache=other, max_new_tokens=5),
                generate(model, "eager", turn2, max_new_tokens=5))
    other.close()


def test_record_tokens_refuses_rows_beam_search_moved():
    """Beam search reorders the cache's rows every step (each row ends holding one beam's past, as
    transformers' own caches do) and returns its beams in another order: recording
    out.sequences would register another beam's K/V under their ids, and a later turn reuse it
    (a review found the next turn's scores off by 1.47). record_tokens refuses with nothing
    recorded; after match_prefix of the next request, greedy rows record again."""
    model = model_for("llama")
    beams = 3
    cache = VkattnCache(model.config, 80, batch_size=beams, dtype="float32", prefix_cache=True)
    turn = ids_of(3, 20)
    cache.match_prefix(turn)
    out = generate(model, "vkattn", turn, cache=cache, max_new_tokens=12, num_beams=beams,
                   num_return_sequences=beams)
    known = [layer._store.pool.token_ids(sid) for layer in cache.layers for sid in layer._store.ids]
    with pytest.raises(ValueError, match="reordered, selected or repeated the cache's rows"):
        cache.record_tokens(out.sequences)
    assert [layer._store.pool.token_ids(sid) for layer in cache.layers for sid in layer._store.ids] == known
    assert cache.match_prefix(turn) == 0                       # nothing learnt
    out = generate(model, "vkattn", turn, cache=cache, max_new_tokens=14)
    cache.record_tokens(out.sequences)                         # greedy, one row: 33 positions recorded
    assert cache.match_prefix(torch.cat([out.sequences[:, :32], ids_of(4, 3)], dim=1)) == 32
    cache.close()
