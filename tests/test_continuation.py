"""Continuation engine tests: a sequence continued over several turns (appended ids prefilled after the turn's
stop id, parked rows left alone, compaction of the columns) samples with the log-probs a full forward pass of
the whole sequence gives (the learner's, at staleness 0); draws depend on the row's key, not on its batch; and
the programs compile once."""

import jax
import numpy as np
import pytest

from conftest import jitted_token_logprobs
from grpo_jax.rollout.continuation import ContinuationEngine
from grpo_jax.rollout.sampler import SamplerConfig
from test_sampler import PAD, _model

STOP = tuple(range(1, 40))  # an eighth of the vocabulary: turns end after a few tokens, some run to their limit
CONFIG = SamplerConfig(max_new_tokens=48, max_prompt_len=16, chunk_steps=4)
ROWS = 6
CONTEXT = 32  # columns 2 x 32: a batch of three turns needs a compaction


@pytest.fixture(scope="module")
def model():
    return _model()


@pytest.fixture(scope="module")
def engine(model):
    return ContinuationEngine(model, STOP, PAD, CONFIG, rows=ROWS, context=CONTEXT)


def _run_turns(engine, prompts, appended_per_turn, keys, budget=6):
    """Drive the engine like the episode runner: extend, decode until every turn ended, append, ... Returns each
    row's full sequence and, per token, its log-prob (nan where it was not sampled)."""
    rows = engine.rows
    engine.reset()
    seqs = [list(p) for p in prompts] + [[]] * (rows - len(prompts))
    lps = [[np.nan] * len(p) for p in prompts] + [[]] * (rows - len(prompts))
    appended = [list(p) for p in prompts] + [None] * (rows - len(prompts))
    restart = [a is not None for a in appended]
    for turn in range(len(appended_per_turn) + 1):
        drawn = engine.extend(appended, restart, keys, [budget] * rows)
        pieces = [drawn]
        while engine.any_active:
            pieces.append(engine.decode())
        for d in pieces:
            for r in range(len(prompts)):
                n = int(d.count[r])
                seqs[r] += d.tokens[r, :n].tolist()
                lps[r] += d.logprobs[r, :n].tolist()
        if turn == len(appended_per_turn):
            break
        appended, restart = [None] * rows, [False] * rows
        for r in range(len(prompts)):
            if r % 3 == 2 and turn == 0:
                continue  # this row stays parked for a turn: its cache must survive the others' programs
            extra = appended_per_turn[turn][r]
            appended[r] = seqs[r][-1:] + extra  # the last sampled token was not fed yet

            seqs[r] += extra
            lps[r] += [np.nan] * len(extra)
    return seqs, lps


def test_continued_turns_match_a_full_forward_pass(engine, model):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(40, 300, size=n).tolist() for n in (3, 9, 16, 5)]
    appended = [[rng.integers(40, 300, size=int(rng.integers(1, 6))).tolist() for _ in prompts] for _ in range(2)]
    keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(3), ROWS)))
    seqs, lps = _run_turns(engine, prompts, appended, keys)
    assert engine.stats["compactions"] >= 1
    assert max(len(s) for s in seqs) > 20
    width = max(len(s) for s in seqs)
    tokens = np.full((len(seqs[:4]), width), PAD, np.int32)
    mask = np.zeros(tokens.shape, bool)
    for r, s in enumerate(seqs[:4]):
        tokens[r, :len(s)], mask[r, :len(s)] = s, True
    full = np.asarray(jitted_token_logprobs(model, tokens, mask)[0])  # [B, L-1]: position t scores token t+1
    sampled = 0
    for r, s in enumerate(seqs[:4]):
        for t in range(1, len(s)):
            if not np.isnan(lps[r][t]):
                np.testing.assert_allclose(lps[r][t], full[r, t - 1], atol=2e-4, err_msg=f"row {r} token {t}")
                sampled += 1
    assert sampled > 20


def test_draws_depend_on_the_row_key_not_the_batch(engine):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(40, 300, size=n).tolist() for n in (4, 7, 11)]
    appended = [[rng.integers(40, 300, size=3).tolist() for _ in prompts]]
    keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(5), ROWS)))
    together, _ = _run_turns(engine, prompts, appended, keys)
    alone, _ = _run_turns(engine, prompts[1:2], [[appended[0][1]]], keys[1:2].repeat(ROWS, 0))
    assert together[1] == alone[0]


def test_programs_compile_once(engine):
    rng = np.random.default_rng(2)
    keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(9), ROWS)))
    counts = []
    for _ in range(2):  # the first batch may compile (this test alone on a worker), the second may not
        prompts = [rng.integers(40, 300, size=5).tolist() for _ in range(ROWS)]
        appended = [[rng.integers(40, 300, size=4).tolist() for _ in prompts]]
        _run_turns(engine, prompts, appended, keys)
        counts.append(engine.num_compilations)
    assert counts[1] == counts[0]
