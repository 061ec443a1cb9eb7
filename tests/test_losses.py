"""Policy losses against an independent per-token NumPy reference, finite-difference gradients, and
padding invariance."""

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_jax.algorithm.losses import (
    LossConfig,
    Trajectories,
    aggregate,
    count_sequences,
    kl_per_token,
    policy_loss,
    sequences_of,
)

B, T = 5, 7


def make_batch(seed, B=B, T=T, spread=0.7, garbage=True):
    """Random log-probs near each other (so clips bind on both sides), ragged masks with one empty
    row, and garbage (NaN/inf/huge) in every padded position."""
    rng = np.random.default_rng(seed)
    old = -np.abs(rng.normal(1.0, 1.0, (B, T)))
    logp = old + spread * rng.normal(size=(B, T))
    beh = old + 0.6 * rng.normal(size=(B, T))
    ref = old + 0.5 * rng.normal(size=(B, T))
    ent = np.abs(rng.normal(size=(B, T)))
    adv = rng.normal(size=B)
    adv[rng.integers(B)] = 0.0
    lengths = rng.integers(1, T + 1, size=B)
    lengths[rng.integers(B)] = 0
    mask = np.arange(T)[None, :] < lengths[:, None]
    if garbage:
        junk = rng.choice([np.nan, np.inf, -np.inf, 1e4, -1e4], size=(B, T))
        for x in (logp, old, beh, ref, ent):
            x[~mask] = junk[~mask]
        adv[lengths == 0] = np.nan
    return dict(logprobs=logp, old_logprobs=old, behaviour_logprobs=beh, ref_logprobs=ref,
                advantages=adv, mask=mask, entropies=ent)


def reference(b, cfg: LossConfig):
    """Per-token loops in float64, written from the papers' formulas (dual clip as max(obj, c*A))."""
    logp, old, beh, ref, adv, mask = (b[k] for k in ("logprobs", "old_logprobs", "behaviour_logprobs",
                                                      "ref_logprobs", "advantages", "mask"))
    Bn, Tn = mask.shape
    pg = np.zeros((Bn, Tn))
    kl = np.zeros((Bn, Tn))
    ratio = np.ones((Bn, Tn))
    for i in range(Bn):
        toks = [t for t in range(Tn) if mask[i, t]]
        if not toks:
            continue
        if cfg.loss_type == "gspo":
            s = math.exp(sum(logp[i, t] - old[i, t] for t in toks) / len(toks))
            lo, hi = 1 - cfg.gspo_clip_low, 1 + cfg.gspo_clip_high
        else:
            lo, hi = 1 - cfg.clip_low, 1 + cfg.clip_high
        A = adv[i]
        for t in toks:
            r = s if cfg.loss_type == "gspo" else math.exp(logp[i, t] - old[i, t])
            ratio[i, t] = r
            obj = min(r * A, min(max(r, lo), hi) * A)
            if cfg.dual_clip is not None and A < 0:
                obj = max(obj, cfg.dual_clip * A)
            loss = -obj
            w = math.exp(old[i, t] - beh[i, t])  # proximal / behaviour
            if cfg.off_policy == "tis":  # Yao et al.: truncate the weight at the cap
                loss *= min(w, cfg.tis_cap)
            elif cfg.off_policy == "decoupled":  # AReaL: behaviour weight, tokens above the cap dropped
                loss *= w if w <= cfg.tis_cap else 0.0
            pg[i, t] = loss
            d = ref[i, t] - logp[i, t]  # log(ref / pi)
            kl[i, t] = {"k1": -d, "k2": 0.5 * d * d, "k3": math.exp(d) - d - 1}[cfg.kl_estimator]
    return pg, kl, ratio


def ref_aggregate(x, mask, cfg):
    rows = [i for i in range(mask.shape[0]) if mask[i].any()]
    if cfg.aggregation == "token_mean":
        return sum(x[i, t] for i in rows for t in range(mask.shape[1]) if mask[i, t]) / max(mask.sum(), 1)
    per_seq = []
    for i in rows:
        vals = [x[i, t] for t in range(mask.shape[1]) if mask[i, t]]
        denom = len(vals) if cfg.aggregation == "seq_mean_token_mean" else cfg.max_completion_len
        per_seq.append(sum(vals) / denom)
    return sum(per_seq) / max(len(per_seq), 1)


def ref_loss(b, cfg):
    pg, kl, _ = reference(b, cfg)
    return (ref_aggregate(pg, b["mask"], cfg) + cfg.kl_coef * ref_aggregate(kl, b["mask"], cfg)
            - cfg.entropy_coef * ref_aggregate(b["entropies"], b["mask"], cfg))


def call(b, cfg, fn=policy_loss, dtype=jnp.float32):
    j = {k: jnp.asarray(v, dtype if k != "mask" else bool) for k, v in b.items()}
    return fn(j["logprobs"], j["old_logprobs"], j["behaviour_logprobs"], j["ref_logprobs"],
              j["advantages"], j["mask"], cfg, entropies=j["entropies"])


AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
MATRIX = list(itertools.product(("grpo", "gspo"), AGGS, (None, 2.5), ("none", "tis", "decoupled"),
                                (0.0, "k1", "k2", "k3")))


def config_for(loss_type, agg, dual, off_policy, kl):
    return LossConfig(loss_type=loss_type, clip_low=0.2, clip_high=0.28, dual_clip=dual,
                      gspo_clip_low=0.1, gspo_clip_high=0.15, aggregation=agg, max_completion_len=T + 3,
                      kl_coef=0.0 if kl == 0.0 else 0.05, kl_estimator="k3" if kl == 0.0 else kl,
                      off_policy=off_policy, tis_cap=1.5)


@pytest.mark.parametrize(
    "seed,case", list(enumerate(MATRIX)), ids=lambda x: "-".join(map(str, x)) if isinstance(x, tuple) else str(x)
)
def test_loss_matches_numpy_reference(seed, case):
    cfg = config_for(*case)
    assert cfg.validate() == []
    b = make_batch(seed)
    loss, metrics = call(b, cfg)
    np.testing.assert_allclose(float(loss), ref_loss(b, cfg), rtol=2e-5, atol=1e-6)
    assert all(np.isfinite(np.asarray(v)) for v in metrics.values())


@pytest.mark.parametrize("loss_type", ["grpo", "gspo"])
def test_metrics_match_numpy(loss_type):
    cfg = config_for(loss_type, "token_mean", 2.5, "tis", "k2")
    b = make_batch(seed=3)
    _, m = call(b, cfg)
    mask = b["mask"]
    pg, kl, ratio = reference(b, cfg)
    A = np.broadcast_to(b["advantages"][:, None], mask.shape)
    lo, hi = ((1 - cfg.clip_low, 1 + cfg.clip_high) if loss_type == "grpo"
              else (1 - cfg.gspo_clip_low, 1 + cfg.gspo_clip_high))
    with np.errstate(invalid="ignore"):  # garbage in the padding
        lr = b["logprobs"] - b["old_logprobs"]
        w = np.exp(b["old_logprobs"] - b["behaviour_logprobs"])
    seqs = mask.any(axis=1)
    advs = b["advantages"][seqs]
    expected = {
        "clip/frac_low": ((A < 0) & (ratio < lo))[mask].mean(),
        "clip/frac_high": ((A > 0) & (ratio > hi))[mask].mean(),
        "clip/frac_dual": ((A < 0) & (ratio > 2.5))[mask].mean(),
        "approx_kl_old": (np.exp(lr) - 1 - lr)[mask].mean(),
        "ratio/max": ratio[mask].max(),
        "ratio/mean": ratio[mask].mean(),
        "tis/weight_mean": w[mask].mean(),
        "tis/weight_max": w[mask].max(),
        "tis/frac_capped": (w > cfg.tis_cap)[mask].mean(),
        "kl/mean": kl[mask].mean(),
        "entropy": b["entropies"][mask].mean(),
        "advantage/mean": advs.mean(),
        "advantage/std": advs.std(),
        "advantage/min": advs.min(),
        "advantage/max": advs.max(),
        "num_tokens": mask.sum(),
        "num_seqs": seqs.sum(),
    }
    for k, v in expected.items():
        np.testing.assert_allclose(float(m[k]), v, rtol=2e-5, atol=1e-6, err_msg=k)
    # Clips must bind somewhere on both sides for this test to mean anything.
    assert 0 < expected["clip/frac_low"] and 0 < expected["clip/frac_high"]


def test_all_padding_batch_is_zero_and_finite():
    b = make_batch(seed=4)
    b["mask"][:] = False
    loss, m = call(b, config_for("grpo", "seq_mean_token_mean", 2.5, "tis", "k3"))
    assert float(loss) == 0.0
    assert all(np.isfinite(np.asarray(v)) for v in m.values())


GRAD_CASES = [
    config_for("grpo", "token_mean", 2.5, "tis", "k3"),
    config_for("grpo", "seq_mean_token_mean", None, "decoupled", "k2"),
    config_for("grpo", "seq_mean_token_sum_norm", None, "none", "k1"),
    config_for("gspo", "seq_mean_token_mean", None, "none", 0.0),
    # GSPO-token's stop-gradient trick gives the true gradient of the sequence objective under any
    # aggregation, as long as there are no per-token weights (so TIS is off here).
    config_for("gspo", "token_mean", 2.5, "none", "k3"),
]


@pytest.mark.parametrize("cfg", GRAD_CASES, ids=lambda c: f"{c.loss_type}-{c.aggregation}")
def test_gradient_matches_finite_differences(cfg):
    b = make_batch(seed=11, B=3, T=4)
    mask = b["mask"]
    with jax.enable_x64(True):
        grad = jax.grad(lambda lp: call({**b, "logprobs": lp}, cfg, dtype=jnp.float64)[0])(
            jnp.asarray(b["logprobs"], jnp.float64))
        grad = np.asarray(grad)
    assert grad.dtype == np.float64
    assert np.all(grad[~mask] == 0.0)
    h = 1e-6
    fd = np.zeros_like(grad)
    for i, t in zip(*np.nonzero(mask)):
        plus, minus = b["logprobs"].copy(), b["logprobs"].copy()
        plus[i, t] += h
        minus[i, t] -= h
        fd[i, t] = (ref_loss({**b, "logprobs": plus}, cfg) - ref_loss({**b, "logprobs": minus}, cfg)) / (2 * h)
    np.testing.assert_allclose(grad[mask], fd[mask], rtol=1e-5, atol=1e-8)
    assert np.abs(fd).max() > 1e-3


def test_on_policy_gradient_is_reinforce():
    # At ratio 1, no clipping and behaviour == proximal: d loss / d logp_t = -A_i / num_tokens (token_mean).
    b = make_batch(seed=5, garbage=False)
    b["old_logprobs"] = b["logprobs"].copy()
    b["behaviour_logprobs"] = b["logprobs"].copy()
    cfg = LossConfig()
    grad = jax.grad(lambda lp: call({**b, "logprobs": lp}, cfg)[0])(jnp.asarray(b["logprobs"], jnp.float32))
    expected = -np.broadcast_to(b["advantages"][:, None], b["mask"].shape) * b["mask"] / b["mask"].sum()
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-5, atol=1e-7)


def pad(b, extra_t, extra_b, rng):
    """The same batch with extra padded columns and rows full of garbage."""
    out = {}
    for k, v in b.items():
        if k == "advantages":
            out[k] = np.concatenate([v, rng.normal(size=extra_b) * 1e3])
        elif k == "mask":
            out[k] = np.pad(v, ((0, extra_b), (0, extra_t)))
        else:
            junk = rng.choice([np.nan, np.inf, -1e4, 7.0], size=(v.shape[0] + extra_b, v.shape[1] + extra_t))
            junk[: v.shape[0], : v.shape[1]] = v
            out[k] = junk
    return out


_jitted = jax.jit(policy_loss, static_argnames="config")
_jitted_value_and_grad = jax.jit(
    jax.value_and_grad(lambda lp, old, beh, ref, adv, mask, config, entropies:
                       policy_loss(lp, old, beh, ref, adv, mask, config, entropies), has_aux=True),
    static_argnames="config")

# Between them every feature: both loss types, all aggregations, dual clip, both TIS modes, all KLs.
PAD_CASES = [("grpo", "token_mean", 2.5, "tis", "k3"), ("grpo", "seq_mean_token_sum_norm", None, "decoupled", "k1"),
             ("gspo", "seq_mean_token_mean", 2.5, "tis", "k2"), ("gspo", "token_mean", None, "none", 0.0)]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), case=st.sampled_from(PAD_CASES))
def test_padding_never_changes_loss_gradient_or_metrics(seed, case):
    # Fixed shapes and four configs: at most eight compilations, however many examples.
    cfg = config_for(*case)
    b = make_batch(seed, B=4, T=5)
    padded = pad(b, extra_t=3, extra_b=2, rng=np.random.default_rng(seed + 1))
    (l1, m1), g1 = call(b, cfg, fn=_jitted_value_and_grad)
    (l2, m2), g2 = call(padded, cfg, fn=_jitted_value_and_grad)
    np.testing.assert_allclose(float(l2), float(l1), rtol=1e-5, atol=1e-7)
    g1, g2 = np.asarray(g1), np.asarray(g2)
    np.testing.assert_allclose(g2[:4, :5][b["mask"]], g1[b["mask"]], rtol=1e-5, atol=1e-7)
    assert np.all(g2[~padded["mask"]] == 0.0)
    for k in m1:
        np.testing.assert_allclose(float(m2[k]), float(m1[k]), rtol=1e-5, atol=1e-6, err_msg=k)


def test_jit_matches_eager():
    cfg = config_for("gspo", "seq_mean_token_mean", 2.5, "decoupled", "k3")
    b = make_batch(seed=8)
    l1, m1 = call(b, cfg)
    l2, m2 = call(b, cfg, fn=_jitted)
    np.testing.assert_allclose(float(l1), float(l2), rtol=1e-6)
    assert m1.keys() == m2.keys()


def test_reference_and_behaviour_optional():
    b = make_batch(seed=9, garbage=False)
    j = {k: jnp.asarray(v) for k, v in b.items()}
    cfg = LossConfig(off_policy="none")
    assert not cfg.needs_reference
    loss, m = policy_loss(j["logprobs"], j["old_logprobs"], None, None, j["advantages"], j["mask"], cfg)
    assert np.isfinite(float(loss)) and "kl/mean" not in m and "tis/weight_mean" not in m
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(j["logprobs"], j["old_logprobs"], None, None, j["advantages"], j["mask"],
                    LossConfig(kl_coef=0.1, off_policy="none"))
    with pytest.raises(ValueError, match="behaviour_logprobs"):
        policy_loss(j["logprobs"], j["old_logprobs"], None, None, j["advantages"], j["mask"],
                    LossConfig(off_policy="tis"))
    assert LossConfig(kl_coef=0.1).needs_reference


def test_float_mask_equals_bool_mask():
    b = make_batch(seed=10)
    cfg = config_for("grpo", "seq_mean_token_sum_norm", None, "tis", "k1")
    l_bool, _ = call(b, cfg)
    l_float, _ = call({**b, "mask": b["mask"].astype(np.float32)}, cfg)
    assert float(l_bool) == float(l_float)


def test_aggregate_simple_values():
    x = jnp.array([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    m = jnp.array([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert float(aggregate(x, m, "token_mean")) == pytest.approx(10 / 4)
    assert float(aggregate(x, m, "seq_mean_token_mean")) == pytest.approx((2 + 4) / 2)
    assert float(aggregate(x, m, "seq_mean_token_sum_norm", 6)) == pytest.approx((6 / 6 + 4 / 6) / 2)


def entropy_gradient(b, cfg: LossConfig) -> np.ndarray:
    """d loss / d entropies for batch `b`: where the entropy bonus (and its floor) reaches, and with what weight."""
    j = {k: jnp.asarray(v, jnp.float32 if k != "mask" else bool) for k, v in b.items()}
    return np.asarray(jax.grad(lambda ent: policy_loss(j["logprobs"], j["old_logprobs"], j["behaviour_logprobs"],
                                                       j["ref_logprobs"], j["advantages"], j["mask"], cfg,
                                                       entropies=ent)[0])(j["entropies"]))


@pytest.mark.parametrize("aggregation", AGGS)
def test_entropy_bonus_matches_numpy_and_its_gradient_is_the_aggregations_weight(aggregation):
    cfg = dataclasses.replace(config_for("grpo", aggregation, 2.5, "tis", "k3"), entropy_coef=0.03)
    assert cfg.validate() == []
    b = make_batch(seed=21)
    loss, _ = call(b, cfg)
    np.testing.assert_allclose(float(loss), ref_loss(b, cfg), rtol=2e-5, atol=1e-6)
    without, _ = call(b, dataclasses.replace(cfg, entropy_coef=0.0))
    assert float(without) - float(loss) > 1e-3  # the bonus lowers the loss: entropies are >= 0
    grad = entropy_gradient(b, cfg)
    mask = b["mask"]
    lengths, sequences = mask.sum(1, keepdims=True), mask.any(1).sum()
    per_token = {"token_mean": np.full(mask.shape, 1.0 / mask.sum()),
                 "seq_mean_token_mean": 1.0 / np.maximum(lengths, 1) / sequences + 0.0 * mask,
                 "seq_mean_token_sum_norm": np.full(mask.shape, 1.0 / (cfg.max_completion_len * sequences))}
    np.testing.assert_allclose(grad, np.where(mask, -cfg.entropy_coef * per_token[aggregation], 0.0), rtol=1e-5,
                               atol=1e-9)  # and exactly 0 on the padding's garbage


def test_entropy_floor_bonuses_only_the_tokens_below_it():
    cfg = dataclasses.replace(config_for("grpo", "token_mean", None, "tis", 0.0), entropy_coef=0.05)
    b = make_batch(seed=23)
    entropies, mask = b["entropies"], b["mask"]
    floor = float(np.median(entropies[mask]))
    _, metrics = call(b, cfg)
    assert "entropy/below_floor" not in metrics
    floored, floored_metrics = call(b, dataclasses.replace(cfg, entropy_floor=floor))
    without, _ = call(b, dataclasses.replace(cfg, entropy_coef=0.0))
    # NumPy: the bonus is on min(entropy, floor), token_mean over the mask.
    expected_bonus = np.minimum(entropies, floor)[mask].mean()
    np.testing.assert_allclose(float(without) - float(floored), cfg.entropy_coef * expected_bonus, rtol=1e-5)
    np.testing.assert_allclose(float(floored_metrics["entropy/below_floor"]), (entropies < floor)[mask].mean(),
                               rtol=1e-6)
    # The gradient reaches exactly the tokens below the floor (above it the bonus is a constant).
    grad = entropy_gradient(b, dataclasses.replace(cfg, entropy_floor=floor))
    below = mask & (entropies < floor)
    assert below.any() and (mask & ~below).any()
    np.testing.assert_allclose(grad[below], -cfg.entropy_coef / mask.sum(), rtol=1e-5)
    assert not grad[~below].any()


def test_entropy_floor_needs_a_positive_floor_and_a_bonus():
    assert LossConfig(entropy_coef=0.01, entropy_floor=0.5).validate() == []
    assert LossConfig(entropy_coef=0.01, entropy_floor=0.0).validate() == [
        "entropy_floor=0.0: allowed None (the bonus on every token) or > 0 nats"]
    assert LossConfig(entropy_floor=0.5).validate() == [
        "entropy_floor=0.5: needs entropy_coef > 0 (the bonus it bounds)"]


def test_entropy_bonus_needs_entropies():
    b = make_batch(seed=22, garbage=False)
    j = {k: jnp.asarray(v) for k, v in b.items()}
    with pytest.raises(ValueError, match="entropy_coef=0.01 needs entropies"):
        policy_loss(j["logprobs"], j["old_logprobs"], j["behaviour_logprobs"], None, j["advantages"], j["mask"],
                    LossConfig(entropy_coef=0.01))


def test_validate():
    assert LossConfig().validate() == []
    problems = LossConfig(loss_type="ppo", aggregation="sum", kl_estimator="k4", off_policy="on", clip_low=1.5,
                          clip_high=-0.1, dual_clip=0.5, tis_cap=0.0, kl_coef=-1.0, entropy_coef=-0.1).validate()
    keys = [p.split("=")[0] for p in problems]
    assert keys == ["loss_type", "aggregation", "kl_estimator", "off_policy", "clip_low", "clip_high", "kl_coef",
                    "entropy_coef", "dual_clip", "tis_cap"]
    assert problems[0] == "loss_type='ppo': allowed grpo, gspo"
    assert LossConfig(aggregation="seq_mean_token_sum_norm").validate()[0].startswith("max_completion_len=0")


# ---- settings that are valid but train something else than intended (issue 20, item 21) -------------------


def config_warnings(*overrides):
    from grpo_jax.config_io import build_config
    from grpo_jax.run.config import Config
    return build_config(Config, {"tokenizer": "byte"}, list(overrides)).warnings()


def test_gspo_with_token_mean_is_warned_and_its_sequence_level_aggregation_is_not():
    (warning,) = [w for w in config_warnings("loss.loss_type=gspo") if "gspo" in w]
    assert warning.startswith("loss.loss_type=gspo with loss.aggregation=token_mean:")
    assert "loss.aggregation=seq_mean_token_mean" in warning
    assert not [w for w in config_warnings("loss.loss_type=gspo", "loss.aggregation=seq_mean_token_mean")
                if "gspo" in w]
    # Why: with token_mean a sequence's term weighs by its length; GSPO's objective weighs each sequence once.
    b = make_batch(seed=12, garbage=False)
    lengths = b["mask"].sum(axis=1)
    assert len(set(lengths[lengths > 0])) > 1
    seq_mean, _ = call(b, config_for("gspo", "seq_mean_token_mean", None, "none", 0.0))
    token_mean, _ = call(b, config_for("gspo", "token_mean", None, "none", 0.0))
    pg, _, _ = reference(b, config_for("gspo", "seq_mean_token_mean", None, "none", 0.0))
    rows = lengths > 0
    per_sequence = np.array([pg[i, 0] for i in np.flatnonzero(rows)])  # GSPO: one term per sequence
    np.testing.assert_allclose(float(seq_mean), per_sequence.mean(), rtol=1e-5)
    assert abs(float(token_mean) - per_sequence.mean()) > 1e-3


def test_k1_kl_as_a_loss_is_warned_and_its_expected_gradient_is_zero():
    (warning,) = [w for w in config_warnings("loss.kl_coef=0.1", "loss.kl_estimator=k1") if "kl_estimator" in w]
    assert warning.startswith("loss.kl_estimator=k1 with loss.kl_coef=0.1: as a loss term k1") and "k3" in warning
    assert not [w for w in config_warnings("loss.kl_coef=0.1") if "kl_estimator" in w]  # k3, the default
    assert not [w for w in config_warnings("loss.kl_estimator=k1") if "kl_estimator" in w]  # no KL term at all
    # Why: d/dtheta of E_{a ~ pi}[log pi(a) - log ref(a)] through the samples' log-probs is E[grad log pi] = 0.
    # Exactly, over a categorical pi = softmax(theta): sum_a pi(a) * d k1(a) / d theta = 0 for k1, not for k2.
    rng = np.random.default_rng(0)
    theta, ref = jnp.asarray(rng.normal(size=7)), jnp.asarray(jax.nn.log_softmax(rng.normal(size=7)))
    pi = jax.nn.softmax(theta)

    def expected_gradient(estimator):
        per_token = jax.jacobian(lambda t: kl_per_token(jax.nn.log_softmax(t), ref, estimator))(theta)
        return np.asarray(pi @ per_token)

    np.testing.assert_allclose(expected_gradient("k1"), 0.0, atol=1e-6)
    assert np.abs(expected_gradient("k2")).max() > 1e-2


# ---- trajectories cut into segments (multi-turn): one sequence for the sequence-level reductions (issue 36, 16) ----


def segmented_batch(seed, B=8, T=5, trajectories=3):
    """make_batch's rows as the segments of `trajectories` trajectories (random, ragged, some of one segment), each
    segment with its trajectory's advantage; and the reference: the same tokens with each trajectory as one row (its
    segments' tokens one after the other), which the loss without trajectories must agree with."""
    rng = np.random.default_rng(seed)
    b = make_batch(seed, B=B, T=T)
    owner = rng.integers(0, trajectories, B)
    owner[:trajectories] = np.arange(trajectories)  # every trajectory has a segment (maybe without tokens)
    ids = 100 + 7 * owner  # any values: only equality counts
    adv = rng.normal(size=trajectories)
    b["advantages"] = np.where(b["mask"].any(axis=1), adv[owner], b["advantages"])
    width = max(int(b["mask"][owner == t].sum()) for t in range(trajectories))
    merged = {k: np.zeros((trajectories, width)) for k in b if k not in ("advantages", "mask")}
    merged["mask"] = np.zeros((trajectories, width), bool)
    merged["advantages"] = adv
    for t in range(trajectories):
        rows = np.flatnonzero(owner == t)
        sel = b["mask"][rows]
        n = int(sel.sum())
        for k in merged:
            if k not in ("advantages", "mask"):
                merged[k][t, :n] = b[k][rows][sel]
        merged["mask"][t, :n] = True
    return b, ids, merged


def call_segmented(b, cfg, trajectories, sequence_ids=None):
    """policy_loss (jitted: a handful of programs, not hundreds of eager operations) on batch dict `b`."""
    j = {k: jnp.asarray(v, jnp.float32 if k != "mask" else bool) for k, v in b.items()}
    return _jitted(j["logprobs"], j["old_logprobs"], j["behaviour_logprobs"], j["ref_logprobs"], j["advantages"],
                   j["mask"], cfg, entropies=j["entropies"], sequence_ids=sequence_ids, trajectories=trajectories)


def jitted_grad(loss):
    return jax.jit(jax.grad(loss))


SEGMENT_CASES = [config_for(*case) for case in (
    ("grpo", "seq_mean_token_mean", 2.5, "tis", "k3"), ("grpo", "seq_mean_token_sum_norm", None, "decoupled", "k2"),
    ("gspo", "seq_mean_token_mean", None, "tis", "k1"), ("gspo", "seq_mean_token_sum_norm", 2.5, "none", 0.0),
    ("grpo", "token_mean", None, "tis", "k3"), ("gspo", "token_mean", None, "none", 0.0))]


@pytest.mark.parametrize("seed, cfg", list(enumerate(SEGMENT_CASES)),
                         ids=[f"{c.loss_type}-{c.aggregation}" for c in SEGMENT_CASES])
def test_a_trajectorys_segments_are_one_sequence(seed, cfg):
    """Loss (NumPy reference), gradient and every metric of a segmented batch with Trajectories are those of the
    same tokens with each trajectory one row: a trajectory of k segments counts once in the sequence means, GSPO's
    ratio and its clip are the trajectory's; without Trajectories it would count k times (the check can fail)."""
    cfg = dataclasses.replace(cfg, entropy_coef=0.02)
    b, ids, merged = segmented_batch(seed)
    trajectories = Trajectories(jnp.asarray(ids))
    loss, metrics = call_segmented(b, cfg, trajectories)
    np.testing.assert_allclose(float(loss), ref_loss(merged, cfg), rtol=2e-5, atol=1e-6)
    want_loss, want = call(merged, cfg, fn=_jitted)
    for key in want:
        np.testing.assert_allclose(float(metrics[key]), float(want[key]), rtol=2e-5, atol=1e-6, err_msg=key)
    assert float(metrics["num_seqs"]) == pytest.approx(3.0)
    # Per token: the gradient of each segment's token is its token's in the merged row.
    grad = np.asarray(jitted_grad(lambda lp: call_segmented({**b, "logprobs": lp}, cfg, trajectories)[0])(
        jnp.asarray(b["logprobs"], jnp.float32)))
    want_grad = np.asarray(jitted_grad(lambda lp: call({**merged, "logprobs": lp}, cfg, fn=_jitted)[0])(
        jnp.asarray(merged["logprobs"], jnp.float32)))
    owner = (ids - 100) // 7
    for t in range(3):
        np.testing.assert_allclose(grad[owner == t][b["mask"][owner == t]], want_grad[t][merged["mask"][t]],
                                   rtol=1e-5, atol=1e-8)
    assert not grad[~b["mask"]].any()
    if cfg.aggregation != "token_mean" or cfg.loss_type == "gspo":
        assert abs(float(call(b, cfg, fn=_jitted)[0]) - float(want_loss)) > 1e-4  # per segment, it differs


def test_trajectories_of_one_segment_change_nothing():
    b = make_batch(seed=31)
    for cfg in SEGMENT_CASES[:4]:
        plain, plain_metrics = call(b, cfg, fn=_jitted)
        each, each_metrics = call_segmented(b, cfg, Trajectories(jnp.arange(B) * 3))
        assert float(each) == float(plain)
        for key in plain_metrics:
            np.testing.assert_allclose(float(each_metrics[key]), float(plain_metrics[key]), rtol=1e-6, err_msg=key)


def test_packed_slots_and_parts_of_a_batch_add_up_to_the_whole():
    """The same segments two to a row (sequence slots, as the learner packs them) give the padded layout's loss and
    metrics; and parts of the batch (the learner's micro-batches), given their trajectories' token counts and
    (GSPO) mean log-ratios over the whole, add up to the whole's loss and gradient, weighted by count_sequences."""
    cfg = dataclasses.replace(config_for("gspo", "seq_mean_token_mean", None, "tis", "k3"), gspo_clip_low=0.01,
                              gspo_clip_high=0.01)
    b, ids, _ = segmented_batch(4, B=8, T=5)
    whole, whole_metrics = call_segmented(b, cfg, Trajectories(jnp.asarray(ids)))
    # Packed: row r holds segments 2r (slot 0) and 2r + 1 (slot 1), the first's tokens then the second's.
    mask = b["mask"]
    packed = {k: np.zeros((4, 10)) for k in b if k not in ("advantages", "mask")}
    packed["mask"] = np.zeros((4, 10), bool)
    slots = np.zeros((4, 10), np.int32)
    for r in range(4):
        at = 0
        for slot, i in enumerate((2 * r, 2 * r + 1)):
            n = int(mask[i].sum())
            for k in packed:
                if k != "mask":
                    packed[k][r, at:at + n] = b[k][i][mask[i]]
            packed["mask"][r, at:at + n], slots[r, at:at + n] = True, slot
            at += n
    packed["advantages"] = b["advantages"].reshape(4, 2)
    loss, metrics = call_segmented(packed, cfg, Trajectories(jnp.asarray(ids.reshape(4, 2))),
                                   sequence_ids=jnp.asarray(slots))
    np.testing.assert_allclose(float(loss), float(whole), rtol=1e-5)
    for key in whole_metrics:
        np.testing.assert_allclose(float(metrics[key]), float(whole_metrics[key]), rtol=1e-5, atol=1e-7, err_msg=key)

    # Parts: rows 0, 2, 4, 6 and 1, 3, 5, 7, each given its trajectories' totals over the whole batch.
    j = {k: jnp.asarray(v, jnp.float32 if k != "mask" else bool) for k, v in b.items()}
    @jax.jit
    def over_the_whole(mask, advantages, log_ratio, ids):
        everything = sequences_of(mask, advantages, trajectories=Trajectories(ids))
        per_slot = everything.over_trajectory(everything.sum(jnp.where(mask, log_ratio, 0.0)))
        return (everything.lengths, per_slot / jnp.maximum(everything.lengths, 1.0),
                count_sequences(mask, advantages, trajectories=Trajectories(ids)))

    lengths, log_ratio, total = over_the_whole(j["mask"], j["advantages"], j["logprobs"] - j["old_logprobs"],
                                               jnp.asarray(ids))
    assert float(total) == pytest.approx(3.0)

    def parts_loss(lp):
        out = 0.0
        for part in (slice(0, None, 2), slice(1, None, 2)):
            given = Trajectories(jnp.asarray(ids[part]), lengths[part], log_ratio[part])
            loss, _ = policy_loss(
                lp[part], j["old_logprobs"][part], j["behaviour_logprobs"][part], j["ref_logprobs"][part],
                j["advantages"][part], j["mask"][part], cfg, entropies=j["entropies"][part], trajectories=given)
            out = out + loss * count_sequences(j["mask"][part], j["advantages"][part], trajectories=given) / total
        return out

    def whole_loss(lp):
        return call_segmented({**b, "logprobs": lp}, cfg, Trajectories(jnp.asarray(ids)))[0]

    lp = jnp.asarray(b["logprobs"], jnp.float32)
    np.testing.assert_allclose(float(jax.jit(parts_loss)(lp)), float(whole), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(jitted_grad(parts_loss)(lp)), np.asarray(jitted_grad(whole_loss)(lp)),
                               rtol=1e-5, atol=1e-8)
    # ... whereas without the whole's totals each part would see only its own segments (the check can fail).
    naive = sum(float(_jitted(lp[p], j["old_logprobs"][p], j["behaviour_logprobs"][p], j["ref_logprobs"][p],
                              j["advantages"][p], j["mask"][p], cfg, entropies=j["entropies"][p],
                              trajectories=Trajectories(jnp.asarray(ids[p])))[0]) / 2
                for p in (slice(0, None, 2), slice(1, None, 2)))
    assert abs(naive - float(whole)) > 1e-4
