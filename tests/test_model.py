"""The hybrid model and its cache: every way of running a sequence gives the same numbers.

prefill(whole) == prefill(pieces) == token-by-token decode == forward() from scratch,
final caches equal, clone / checkpoint / from_checkpoint resume exactly, the public
layers run a slice of a sequence, and truncate + re-prefill == never going past n.
"""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from fuzzing import examples

from kimilab import kda
from kimilab.config import all_mla_27, kimi_linear_48b, tiny
from kimilab.model import CAPTURE_KEYS, HybridCache, KDACapture, KDALayer, Model, StateCheckpoint, rms_norm

# Small chunks so a few dozen tokens already cross several chunk boundaries.
TINY64 = tiny.with_(name="tiny-c8", chunk_size=8)
TINY32 = tiny.with_(name="tiny-f32", chunk_size=8, dtype="float32")
MODELS = {"f64": Model(TINY64, seed=0), "f32": Model(TINY32, seed=0)}
TOL = {"f64": 1e-10, "f32": 1e-5}
FULL = {}


def _tokens(n, seed=0):
    return np.random.default_rng(seed).integers(0, tiny.vocab_size, size=n)


def _forward(key, tokens):
    """forward() logits of a fixed 48-token stream (computed once; prefixes are consistent)."""
    if key not in FULL:
        FULL[key] = MODELS[key].forward(tokens)
    return FULL[key]


def _max_cache_diff(a, b):
    cfg = a.config
    d = [np.max(np.abs(a.kda_state(i) - b.kda_state(i))) for i in cfg.kda_layers]
    d += [np.max(np.abs(a.conv_state(i) - b.conv_state(i))) for i in cfg.kda_layers]
    for i in cfg.attn_layers:
        (ka, va), (kb, vb) = a.kv(i), b.kv(i)
        assert ka.shape == kb.shape
        d += [np.max(np.abs(ka - kb), initial=0.0), np.max(np.abs(va - vb), initial=0.0)]
    assert a.seq_len == b.seq_len
    return max(d)


STREAM = _tokens(48, seed=7)
plan = st.lists(st.tuples(st.sampled_from(["prefill", "decode"]), st.integers(1, 13)), min_size=1, max_size=6)


@pytest.mark.parametrize("key", ["f64", "f32"])
@settings(max_examples=examples(12), deadline=None)
@given(steps=plan)
def test_pieces_and_decode_equal_whole_and_forward(key, steps):
    model, tol = MODELS[key], TOL[key]
    # Turn the plan into consecutive pieces of STREAM (stop at its end).
    pieces, pos = [], 0
    for how, n in steps:
        n = min(n, len(STREAM) - pos)
        if n == 0:
            break
        pieces.append((how, STREAM[pos:pos + n]))
        pos += n
    tokens = STREAM[:pos]
    whole_cache = model.new_cache()
    whole = model.prefill(tokens, whole_cache)
    ref = _forward(key, STREAM)[:pos]
    assert whole.shape == (pos, tiny.vocab_size) and whole.dtype == model.dtype
    assert np.max(np.abs(whole - ref)) <= tol

    cache, outs = model.new_cache(), []
    for how, piece in pieces:
        if how == "prefill":
            outs.append(model.prefill(piece, cache))
        else:
            outs.extend(model.decode(int(t), cache)[None] for t in piece)
    assert np.max(np.abs(np.concatenate(outs) - whole)) <= tol
    assert cache.seq_len == pos
    assert _max_cache_diff(cache, whole_cache) <= tol


def test_full_decode_equals_forward_long():
    """Token-by-token decode over 70 tokens at the real chunk size (crosses a 64 boundary)."""
    model = Model(tiny, seed=3)
    tokens = _tokens(70, seed=3)
    ref = model.forward(tokens)
    cache = model.new_cache()
    dec = np.stack([model.decode(int(t), cache) for t in tokens])
    assert np.max(np.abs(dec - ref)) <= 1e-10
    whole = model.new_cache()
    assert np.max(np.abs(model.prefill(tokens, whole) - ref)) <= 1e-10
    assert _max_cache_diff(cache, whole) <= 1e-10


def test_prefill_uses_chunked_kda_and_decode_uses_step(monkeypatch):
    model = MODELS["f64"]
    calls = []
    real_chunk, real_step = kda.chunk_kda, kda.kda_step

    def no(*a, **k):
        raise AssertionError("wrong KDA path")

    monkeypatch.setattr(kda, "recurrent_kda", no)
    monkeypatch.setattr(kda, "kda_step", no)
    monkeypatch.setattr(kda, "chunk_kda", lambda *a, **k: calls.append("chunk") or real_chunk(*a, **k))
    cache = model.new_cache()
    model.prefill(STREAM[:20], cache)
    assert calls.count("chunk") == len(tiny.kda_layers)
    monkeypatch.setattr(kda, "chunk_kda", no)
    monkeypatch.setattr(kda, "kda_step", lambda *a, **k: calls.append("step") or real_step(*a, **k))
    model.decode(5, cache)
    assert calls.count("step") == len(tiny.kda_layers)


def test_clone_is_independent_and_resumes_exactly():
    model = MODELS["f64"]
    cache = model.new_cache()
    model.prefill(STREAM[:20], cache)
    twin = cache.clone()
    assert type(twin) is HybridCache and twin.nbytes == cache.nbytes
    a = model.prefill(STREAM[20:30], cache)
    model.prefill(_tokens(10, seed=99), twin.clone())  # a diverging branch touches neither
    b = model.prefill(STREAM[20:30], twin)
    assert np.max(np.abs(a - b)) == 0.0
    assert _max_cache_diff(cache, twin) == 0.0


def test_checkpoint_and_from_checkpoint_resume_exactly():
    model = MODELS["f64"]
    cache = model.new_cache()
    model.prefill(STREAM[:25], cache)
    ckpt = cache.checkpoint()
    assert isinstance(ckpt, StateCheckpoint) and ckpt.seq_len == 25
    assert ckpt.nbytes == cache.nbytes_by_kind()["kda_state"] + cache.nbytes_by_kind()["conv_state"]
    tail = model.prefill(STREAM[25:40], cache)  # the original moves on; the checkpoint must not
    kv = {i: cache.kv(i) for i in tiny.attn_layers}
    kv = {i: (k[:25], v[:25]) for i, (k, v) in kv.items()}
    resumed = HybridCache.from_checkpoint(TINY64, ckpt, kv=kv)
    assert resumed.seq_len == 25
    again = model.prefill(STREAM[25:40], resumed)
    assert np.max(np.abs(again - tail)) == 0.0
    assert _max_cache_diff(resumed, cache) == 0.0
    with pytest.raises(ValueError, match="read-only"):
        ckpt.kda_states[0][0, 0, 0] = 1.0  # read-only copy
    with pytest.raises(ValueError, match="missing"):
        HybridCache.from_checkpoint(TINY64, ckpt)
    with pytest.raises(ValueError, match="25 rows"):
        HybridCache.from_checkpoint(TINY64, ckpt, kv={i: (k[:3], v[:3]) for i, (k, v) in kv.items()})
    with pytest.raises(ValueError, match="does not match"):
        HybridCache.from_checkpoint(tiny, ckpt, kv=kv)


def test_capture_concatenates_and_replays_the_state():
    model = MODELS["f64"]
    whole, pieces = {}, {}
    c1, c2 = model.new_cache(), model.new_cache()
    model.prefill(STREAM[:30], c1, capture=whole)
    model.prefill(STREAM[:11], c2, capture=pieces)
    model.decode(int(STREAM[11]), c2, capture=pieces)
    model.prefill(STREAM[12:30], c2, capture=pieces)
    H, K = tiny.n_heads, tiny.head_dim
    assert sorted(whole) == list(tiny.kda_layers)
    for i in tiny.kda_layers:
        cap = whole[i]
        assert isinstance(cap, KDACapture) and len(cap) == 30
        assert cap.q_in.shape == (30, H * K) and cap.q.shape == (30, H, K)
        assert cap.g.shape == (30, H, K) and cap.beta.shape == (30, H)
        for name in CAPTURE_KEYS:
            assert np.max(np.abs(getattr(pieces[i], name) - getattr(cap, name))) <= 1e-12
        np.testing.assert_array_equal(c1.conv_state(i), cap.conv_inputs[-(tiny.conv_kernel - 1):])
        _, S = kda.recurrent_kda(*cap.kernel_inputs())
        assert np.max(np.abs(S - c1.kda_state(i))) <= 1e-10
        head = cap[:12]  # slicing selects tokens
        assert len(head) == 12 and np.array_equal(head.concat(cap[12:]).v, cap.v)
    with pytest.raises(ValueError, match="slice"):
        cap[3]


def test_layers_run_slices_like_context_parallelism():
    """project -> mix -> output on two slices, states carried across the cut, == prefill."""
    model = MODELS["f64"]
    tokens = STREAM[:29]
    cut = 13
    h = [model.weights["embed"][tokens[:cut]], model.weights["embed"][tokens[cut:]]]
    for layer, mlp in zip(model.layers, model.mlps):
        conv = state = None
        keys, values = [], []
        for j in (0, 1):
            x = rms_norm(h[j], layer.norm)
            if isinstance(layer, KDALayer):
                cap, conv = layer.project(x, conv)
                o, state = layer.mix(cap, state, kernel="chunk")
                y = layer.output(x, o)
            else:
                q, k, v = layer.project(x)
                keys.append(k), values.append(v)
                y = layer.output(layer.mix(q, np.concatenate(keys), np.concatenate(values)))
            h[j] = h[j] + y
            h[j] = h[j] + mlp(h[j])
    logits = rms_norm(np.concatenate(h), model.weights["final_norm"]) @ model.weights["lm_head"]
    assert np.max(np.abs(logits - model.prefill(tokens, model.new_cache()))) <= 1e-10
    assert [layer.kind for layer in model.layers] == list(tiny.layer_pattern)
    with pytest.raises(ValueError, match="kernel="):
        model.layers[0].mix(cap, kernel="fast")
    with pytest.raises(ValueError, match="x: expected"):
        model.layers[0].project(np.zeros((2, 3)))


def test_generate_is_greedy_over_forward():
    model = MODELS["f64"]
    prompt = [256, 72, 105]
    cache = model.new_cache()
    out = model.generate(prompt, 6, cache=cache)
    assert len(out) == 6 and cache.seq_len == len(prompt) + 5
    seq = list(prompt)
    for t in out:
        assert int(np.argmax(model.forward(seq)[-1])) == t
        seq.append(t)
    assert model.generate(prompt, 0) == []
    first = out[0]
    assert model.generate(prompt, 5, eos_id=first) == [first]


def test_weights_are_seeded_and_activations_stay_order_one():
    a, b, c = Model(tiny, seed=0), Model(tiny, seed=0), Model(tiny, seed=1)
    np.testing.assert_array_equal(a.weights["embed"], b.weights["embed"])
    assert not np.array_equal(a.weights["embed"], c.weights["embed"])
    # default_rng(0).standard_normal is the same stream on every machine
    np.testing.assert_allclose(a.weights["embed"][0, :3], np.random.default_rng(0).standard_normal(3))
    logits = a.forward(_tokens(40))
    assert np.isfinite(logits).all() and 0.2 < logits.std() < 5.0


@pytest.mark.parametrize("cfg", [
    tiny.with_(name="tiny-gqa", attn_kind="gqa", attn_heads=4, attn_kv_heads=2, chunk_size=8),
    tiny.with_(name="tiny-lb", gate="lowerbound", gate_lower_bound=-2.0, chunk_size=8),
    tiny.with_(name="tiny-odd", layer_pattern="KAK", conv_kernel=2, chunk_size=5),
])
def test_variants_stay_exact(cfg):
    model = Model(cfg, seed=2)
    tokens = _tokens(17, seed=2)
    ref = model.forward(tokens)
    cache = model.new_cache()
    got = np.concatenate([model.prefill(tokens[:9], cache), model.decode(int(tokens[9]), cache)[None],
                          model.prefill(tokens[10:], cache)])
    assert np.max(np.abs(got - ref)) <= 1e-10
    if cfg.gate == "lowerbound":
        cap = {}
        model.prefill(tokens, model.new_cache(), capture=cap)
        g = cap[cfg.kda_layers[0]].g
        assert (g >= cfg.gate_lower_bound).all() and (g < 0).all()


def test_cache_bytes_by_kind():
    model = MODELS["f64"]
    cache = model.new_cache()
    H, K, W = tiny.n_heads, tiny.head_dim, tiny.conv_kernel
    n_kda, n_attn = len(tiny.kda_layers), len(tiny.attn_layers)
    fixed = {"kda_state": n_kda * H * K * K * 8, "conv_state": n_kda * (W - 1) * 3 * H * K * 8}
    assert cache.nbytes_by_kind() == {"kv": 0, **fixed}
    model.prefill(STREAM[:10], cache)
    kv_per_token = n_attn * 2 * tiny.attn_kv_heads_eff * tiny.attn_head_dim_eff * 8
    assert cache.nbytes_by_kind() == {"kv": 10 * kv_per_token, **fixed}
    assert cache.nbytes == 10 * kv_per_token + sum(fixed.values())


def test_bad_inputs_name_the_field():
    model = MODELS["f64"]
    cache = model.new_cache()
    with pytest.raises(ValueError, match="shapes only"):
        Model(kimi_linear_48b)
    with pytest.raises(ValueError, match="shapes only"):
        HybridCache(all_mla_27)
    with pytest.raises(ValueError, match=r"tokens\[2\]=300.*vocab"):
        model.prefill([1, 2, 300], cache)
    with pytest.raises(ValueError, match=r"tokens\[0\]=-1"):
        model.forward([-1])
    with pytest.raises(ValueError, match="token=.*one int"):
        model.decode([1, 2], cache)
    with pytest.raises(ValueError, match="token\\[0\\]=260"):
        model.decode(260, cache)
    with pytest.raises(ValueError, match="tokens: expected integer"):
        model.forward(np.array([1.5]))
    with pytest.raises(ValueError, match="cache: built for config"):
        model.prefill([1], HybridCache(tiny))
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate([1], -1)
    with pytest.raises(ValueError, match="seed"):
        Model(tiny, seed=-1)
    with pytest.raises(ValueError, match="attn_kind='mla'"):
        Model(tiny.with_(attn_kind="mla", kv_lora_rank=16))
    assert cache.seq_len == 0  # failed calls leave the cache alone
    assert model.prefill([], cache).shape == (0, tiny.vocab_size) and cache.seq_len == 0


def test_cache_protocol_errors():
    cache = HybridCache(tiny)
    with pytest.raises(ValueError, match="not a KDA layer"):
        cache.kda_state(3)
    with pytest.raises(ValueError, match="not a global-attention layer"):
        cache.kv(0)
    with pytest.raises(ValueError, match=r"set_kda_state.*\[H, K, V\]"):
        cache.set_kda_state(0, np.zeros((4, 32, 31)))
    with pytest.raises(ValueError, match=r"set_conv_state.*\[W-1, C\]"):
        cache.set_conv_state(0, np.zeros((4, 384)))
    with pytest.raises(ValueError, match=r"append_kv.*\[T, Hkv, Dk\]"):
        cache.append_kv(3, np.zeros((2, 4, 31)), np.zeros((2, 4, 32)))
    with pytest.raises(ValueError, match="append_kv for every global layer"):
        cache.advance(1)
    with pytest.raises(ValueError, match="n=-1"):
        cache.advance(-1)
    with pytest.raises(ValueError):
        cache.kda_state(0)[0, 0, 0] = 1.0  # read-only view: writes go through set_kda_state


@settings(max_examples=examples(6), deadline=None)
@given(n=st.integers(0, 30), extra=st.integers(1, 12), by_decode=st.booleans(), same=st.booleans())
def test_truncate_then_reprefill_equals_never_going_past(n, extra, by_decode, same):
    model = MODELS["f64"]
    cache, ref = model.new_cache(), model.new_cache()
    model.prefill(STREAM[:n], cache), model.prefill(STREAM[:n], ref)
    ckpt = cache.checkpoint()
    past = STREAM[n:n + extra]
    if by_decode:
        for t in past:
            model.decode(int(t), cache)
    else:
        model.prefill(past, cache)
    cache.truncate(n, ckpt)
    assert cache.seq_len == n and cache.nbytes_by_kind() == ref.nbytes_by_kind()
    assert _max_cache_diff(cache, ref) == 0.0
    again = past if same else _tokens(extra, seed=n + 1)  # the same tokens, or a different branch
    a, b = model.prefill(again, cache), model.prefill(again, ref)
    assert np.max(np.abs(a - b)) <= 1e-10
    assert _max_cache_diff(cache, ref) <= 1e-10


def test_truncate_refuses_what_it_cannot_undo():
    model = MODELS["f64"]
    cache = model.new_cache()
    model.prefill(STREAM[:10], cache)
    at5 = model.new_cache()
    model.prefill(STREAM[:5], at5)
    before = cache.checkpoint()
    with pytest.raises(ValueError, match="checkpoint=None.*seq_len == 4"):
        cache.truncate(4)
    with pytest.raises(ValueError, match=r"checkpoint.seq_len=5: .*n=4"):
        cache.truncate(4, at5.checkpoint())
    with pytest.raises(ValueError, match="n=11: expected n <= seq_len=10"):
        cache.truncate(11)
    with pytest.raises(ValueError, match="n=-1"):
        cache.truncate(-1)
    with pytest.raises(ValueError, match="checkpoint: expected a StateCheckpoint"):
        cache.truncate(5, {"seq_len": 5})
    assert cache.seq_len == 10 and cache.kv(3)[0].shape[0] == 10  # refused calls change nothing
    assert _max_cache_diff(cache, HybridCache.from_checkpoint(TINY64, before, kv={
        i: cache.kv(i) for i in tiny.attn_layers})) == 0.0
    cache.truncate(10)  # nothing to undo: no checkpoint needed
    cache.truncate(5, at5.checkpoint())
    assert _max_cache_diff(cache, at5) <= 1e-10  # KV rows of a 10-token vs a 5-token matmul
    # a model without KDA layers truncates KV alone
    attn_only = Model(tiny.with_(name="tiny-attn", layer_pattern="AA"), seed=0)
    c = attn_only.new_cache()
    attn_only.prefill(STREAM[:9], c)
    c.truncate(4)
    assert c.seq_len == 4 and c.kv(1)[0].shape[0] == 4
    with c:  # free() on exit; a freed cache refuses to work
        pass
    with pytest.raises(RuntimeError, match="freed"):
        c.kv(1)
