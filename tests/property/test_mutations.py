"""The harness bites: deliberately broken scaled code must be caught by the equivalence check.

Each mutation patches one piece of megarl (a dropped TP all-reduce, a wrong gradient on one rank,
a local instead of global normaliser) and asks hypothesis to *find* a case where megarl and the
reference disagree. If no such case is found the harness is blind to that bug and the test fails.

The method mutants (``METHOD_MUTANTS``, one-line mistakes in the trust-region, credit-assignment
and reward-shaping methods and in PPO's dual clip) are applied to the source of one function at
test time: its code object is swapped for one compiled from the source with ``old`` replaced by
``new``, so every reference to it (registries included) runs the mutant, and nothing on disk
changes. The function is looked up by module path when the test runs; a method may live in one of
several modules (methods move between packages). Each mutant names its killers, tests of the
suite that pass on the real code and must fail on the mutant: a mutant that survives is a
missing test.
"""

import ast
import importlib
import inspect
import textwrap
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import Phase, find, settings

from megarl.ops import comm, vocab_parallel
from megarl.testing.equivalence import megarl_loss_and_grad, reference_loss_and_grad
from tests.property.strategies import rl_cases


def _disagrees(tp, dp=1, mb=1):
    def pred(case):
        ref_loss, ref_grad = reference_loss_and_grad(case)
        try:
            loss, grad = megarl_loss_and_grad(case, tp=tp, dp=dp, micro_batches=mb)
        except AssertionError:  # ranks disagree on the loss: caught too
            return True
        return not (
            torch.allclose(loss, ref_loss, rtol=1e-9, atol=1e-10)
            and torch.allclose(grad, ref_grad, rtol=1e-9, atol=1e-10)
        )

    return pred


def _drop(op_name):
    real = comm.all_reduce

    def broken(t, op, group):
        return t if op == op_name else real(t, op, group)

    return broken


@pytest.mark.parametrize("op", ["sum", "max"])
def test_dropped_tp_all_reduce_is_caught(monkeypatch, op):
    monkeypatch.setattr(comm, "all_reduce", _drop(op))
    case = find(
        rl_cases(torch.float64),
        _disagrees(tp=2),
        settings=settings(max_examples=200, database=None, phases=[Phase.generate]),
    )
    assert case.logits.shape[-1] % 2 == 0


def test_wrong_gradient_on_one_rank_is_caught(monkeypatch):
    real_backward = vocab_parallel._LogprobEntropy.backward

    def broken(ctx, g_logp, g_ent):
        grads = real_backward(ctx, g_logp, g_ent)
        if comm.rank(ctx.group) == 1:
            return (grads[0] * 1.001,) + grads[1:]
        return grads

    real_forward = vocab_parallel._LogprobEntropy.forward

    def forward(ctx, logits, targets, group, chunk, with_entropy, inplace_backward=False):
        ctx.group = group
        return real_forward(ctx, logits, targets, group, chunk, with_entropy, inplace_backward)

    monkeypatch.setattr(vocab_parallel._LogprobEntropy, "backward", staticmethod(broken))
    monkeypatch.setattr(vocab_parallel._LogprobEntropy, "forward", staticmethod(forward))
    find(
        rl_cases(torch.float64),
        _disagrees(tp=2),
        settings=settings(max_examples=200, database=None, phases=[Phase.generate]),
    )


def test_local_instead_of_global_normaliser_is_caught(monkeypatch):
    from megarl.objectives import api

    real = api.GlobalNormalisers.from_batch

    def local_only(batch, dp_group=None, max_response_len=0.0):
        return real(batch, None, max_response_len)

    monkeypatch.setattr(api.GlobalNormalisers, "from_batch", staticmethod(local_only))
    find(
        rl_cases(torch.float64, min_groups=2, min_group_size=2),
        _disagrees(tp=1, dp=2),
        settings=settings(max_examples=200, database=None, phases=[Phase.generate]),
    )


@dataclass(frozen=True)
class Mutant:
    """One-line mistake ``old`` -> ``new`` in ``function`` (qualname) of the first module of
    ``modules`` that has it; ``killers``: ``"tests.module:test_name"`` that must catch it."""

    name: str
    modules: tuple[str, ...]
    function: str
    old: str
    new: str
    killers: tuple[str, ...]


METHOD_MUTANTS = [
    # family 1, trust regions
    Mutant(
        "eppo_ema_momentum_swapped",
        ("megarl.methods.trust_regions.eppo",),
        "EppoState.update",
        "momentum * self.ema + (1 - momentum) * mu",
        "(1 - momentum) * self.ema + momentum * mu",
        ("tests.methods.test_eppo:test_ema_keeps_the_momentum_share_on_the_past",),
    ),
    Mutant(
        "cokl_active_groups_counted_per_rank",
        ("megarl.methods.trust_regions.cokl",),
        "prepare",
        'comm.all_reduce(active, "sum", dp_group)',
        "pass",
        ("tests.methods.test_cokl:test_data_parallel_shares_prepare_the_whole_batch_weights",),
    ),
    # PPO's dual clip (the policy loss under every family)
    Mutant(
        "ppo_dual_clip_bound_sign",
        ("megarl.objectives.policy_losses",),
        "ppo",
        "-dual_clip * adv",
        "dual_clip * adv",
        ("tests.unit.test_dual_clip:test_ppo_dual_clip_values_and_gradients",),
    ),
    Mutant(
        "ppo_dual_clip_max_instead_of_min",
        ("megarl.objectives.policy_losses",),
        "ppo",
        "torch.minimum(loss, -dual_clip * adv)",
        "torch.maximum(loss, -dual_clip * adv)",
        ("tests.unit.test_dual_clip:test_ppo_dual_clip_values_and_gradients",),
    ),
    Mutant(
        "ppo_dual_clip_on_positive_advantages",
        ("megarl.objectives.policy_losses",),
        "ppo",
        "torch.where(adv < 0,",
        "torch.where(adv > 0,",
        ("tests.unit.test_dual_clip:test_ppo_dual_clip_values_and_gradients",),
    ),
    # family 2, credit assignment
    Mutant(
        "gigpo_step_weight_omega_dropped",
        ("megarl.methods.credit.gigpo",),
        "gigpo_step_advantages",
        "episode[steps.seq] + omega * step_rel",
        "episode[steps.seq] + step_rel",
        ("tests.methods.test_gigpo:test_matches_reference",),
    ),
    Mutant(
        "steps_returns_undiscounted",
        ("megarl.methods.credit.steps",),
        "discounted_returns",
        "r[:, t] + gamma * g[:, t + 1]",
        "r[:, t] + g[:, t + 1]",
        ("tests.methods.test_gigpo:test_matches_reference",),
    ),
    Mutant(
        "rspo_outcome_and_process_branches_swapped",
        ("megarl.methods.credit.rspo", "megarl.rewards.shaping.rspo"),
        "rspo",
        "BASES[base](process, group_ids), a_out)",
        "a_out, BASES[base](process, group_ids))",
        ("tests.methods.test_rspo:test_matches_reference",),
    ),
    # the peers' catalogue (verl core_algos)
    Mutant(
        "gpg_alpha_counts_zero_rewards",
        ("megarl.methods.peers.gpg",),
        "gpg_advantages",
        "(rewards != 0)",
        "(rewards == 0)",
        ("tests.methods.test_gpg:test_advantages_match_reference",),
    ),
    Mutant(
        "gmpo_log_ratio_max_instead_of_min",
        ("megarl.methods.peers.gmpo",),
        "gmpo",
        "sgn * torch.minimum(sgn * d,",
        "sgn * torch.maximum(sgn * d,",
        (
            "tests.methods.test_gmpo:test_matches_reference",
            "tests.methods.test_gmpo:test_one_token_sequences_are_ppo_with_log_space_bounds",
        ),
    ),
    Mutant(
        "clip_cov_keep_probability_inverted",
        ("megarl.methods.peers.cov",),
        "clip_cov_selected",
        "cand & (keys < broadcast_to_tokens(",
        "cand & (keys > broadcast_to_tokens(",
        ("tests.methods.test_cov:test_clip_cov_matches_reference",),
    ),
    Mutant(
        "kl_cov_threshold_from_the_local_shard",
        ("megarl.methods.peers.cov",),
        "prepare_kl_cov",
        "torch.cat(comm.all_gather(local, dp_group))",
        "local",
        (
            "tests.methods.test_cov:test_kl_cov_matches_reference",
            "tests.methods.test_cov:test_kl_cov_selects_the_k_largest_covariances_of_the_global_batch",
        ),
    ),
    Mutant(
        "bypass_token_weight_not_truncated",
        ("megarl.methods.peers.bypass",),
        "is_weights",
        "torch.clamp(torch.exp(d), max=is_threshold)",
        "torch.exp(d)",
        ("tests.methods.test_bypass:test_matches_reference",),
    ),
    Mutant(
        "opo_baseline_not_length_weighted",
        ("megarl.methods.peers.outcome",),
        "opo_advantages",
        "index_add(0, inv, w * rewards)",
        "index_add(0, inv, rewards)",
        ("tests.methods.test_outcome_advantages:test_opo_matches_reference",),
    ),
    Mutant(
        "grpo_passk_second_best_includes_the_best",
        ("megarl.methods.peers.outcome",),
        "grpo_passk_advantages",
        "torch.where(is_best, torch.full_like(rewards, -torch.inf), rewards)",
        "torch.where(is_best, rewards, rewards)",
        ("tests.methods.test_outcome_advantages:test_passk_matches_reference",),
    ),
    Mutant(
        "remax_baseline_added",
        ("megarl.methods.peers.remax",),
        "remax_advantages",
        "rewards - baselines.to(rewards.dtype)",
        "rewards + baselines.to(rewards.dtype)",
        (
            "tests.methods.test_outcome_advantages:test_remax_matches_reference_and_a_baseline_equal_to_the_reward_gives_zero",
        ),
    ),
    Mutant(
        "kl_abs_without_the_magnitude",
        ("megarl.methods.peers.kl_reward",),
        "kl_abs",
        "(logp - ref_logp).abs()",
        "(logp - ref_logp)",
        ("tests.methods.test_kl_peers:test_kl_estimators_match_reference",),
    ),
    Mutant(
        "kl_k1_k2grad_keeps_the_k1_gradient",
        ("megarl.methods.peers.kl_reward",),
        "kl_k1_k2grad",
        "x.detach() + (k2 - k2.detach())",
        "x + (k2 - k2.detach())",
        ("tests.methods.test_kl_peers:test_k1_value_with_k2_gradient",),
    ),
    Mutant(
        "adaptive_kl_error_not_clipped",
        ("megarl.methods.peers.kl_reward",),
        "KLController.update",
        "min(max(current_kl / self.target_kl - 1, -0.2), 0.2)",
        "current_kl / self.target_kl - 1",
        (
            "tests.methods.test_kl_peers:test_adaptive_controller_moves_toward_the_target_and_is_checkpointed",
            "tests.methods.test_kl_peers:test_kl_reward_matches_reference",
        ),
    ),
    Mutant(
        "otb_weights_not_accumulated",
        ("megarl.methods.peers.otb",),
        "optimal_token_baseline",
        "W = torch.cumsum(w, 1)[s, col]",
        "W = w[s, col]",
        ("tests.methods.test_otb:test_matches_reference",),
    ),
    Mutant(
        "dro_penalty_without_the_half",
        ("megarl.methods.peers.bypass",),
        "dro",
        "0.5 * beta * (logp - batch.rollout_logprobs",
        "beta * (logp - batch.rollout_logprobs",
        ("tests.methods.test_bypass:test_dro_matches_reference",),
    ),
    # reward shaping
    Mutant(
        "reward_floor_precision_denominator",
        ("megarl.rewards.shaping.reward_floor",),
        "ngram_precision",
        "/ (len(response) - n + 1)",
        "/ len(response)",
        (
            "tests.unit.test_ngram_precision:test_ngram_precision_by_hand",
            "tests.methods.test_reward_floor:test_matches_reference",
        ),
    ),
    Mutant(
        "reward_floor_copies_keep_their_reward",
        ("megarl.rewards.shaping.reward_floor",),
        "RewardFloor.__call__",
        "torch.where(copied, torch.full_like(rewards, self.floor), rewards)",
        "torch.where(copied, rewards, torch.full_like(rewards, self.floor))",
        ("tests.methods.test_reward_floor:test_verbatim_copy_is_floored_and_a_rewrite_is_not",),
    ),
    # family 3, critics
    Mutant(
        "value_clip_optimistic_min",
        ("megarl.objectives.value_losses",),
        "value_loss_per_token",
        "0.5 * torch.maximum(unclipped, clipped)",
        "0.5 * torch.minimum(unclipped, clipped)",
        (
            "tests.property.test_value_loss:test_value_loss_matches_reference",
            "tests.property.test_value_loss:test_clipped_is_at_least_mse_and_equals_it_with_a_wide_clip",
        ),
    ),
    Mutant(
        "bpco_lambda_not_clamped_at_zero",
        ("megarl.advantages.estimators",),
        "length_adaptive_lam",
        "lam.clamp(min=0.0, max=1.0)",
        "lam.clamp(max=1.0)",
        (
            "tests.methods.test_bpco:test_short_responses_get_lambda_zero_not_a_negative_one",
            "tests.methods.test_bpco:test_lagae_and_monte_carlo_targets_match_reference",
        ),
    ),
    Mutant(
        "bpco_lambda_alpha_inverted",
        ("megarl.advantages.estimators",),
        "length_adaptive_lam",
        "1.0 - 1.0 / (alpha * L.clamp(min=1.0))",
        "1.0 - alpha / L.clamp(min=1.0)",
        ("tests.methods.test_bpco:test_lagae_and_monte_carlo_targets_match_reference",),
    ),
    Mutant(
        "monte_carlo_targets_with_gae_lambda",
        ("megarl.advantages.estimators",),
        "monte_carlo_returns",
        "batch.cu_seqlens, gamma, 1.0)",
        "batch.cu_seqlens, gamma, 0.95)",
        (
            "tests.methods.test_bpco:test_monte_carlo_targets_are_the_outcome_reward_whatever_alpha_and_values",
        ),
    ),
    Mutant(
        "critic_warmup_one_step_short",
        ("megarl.methods.critics.critic",),
        "Critic.updates_policy",
        "step > self.knobs.warmup_steps",
        "step >= self.knobs.warmup_steps",
        ("tests.methods.test_bpco:test_warmup_holds_the_policy_for_exactly_n_steps",),
    ),
    Mutant(
        "privileged_critic_first_response_token_misplaced",
        ("megarl.methods.critics.privileged",),
        "privileged_batch",
        "(pos >= batch.prompt_lens[seq])",
        "(pos > batch.prompt_lens[seq])",
        (
            "tests.methods.test_privileged_critic:test_sequences_are_prompt_context_response_and_tokens_map_back",
        ),
    ),
]


def _resolve(m: Mutant) -> Callable:
    """The plain function ``m.function`` of the first module of ``m.modules`` that defines it."""
    for path in m.modules:
        try:
            obj = importlib.import_module(path)
        except ModuleNotFoundError as e:
            if e.name != path:  # the module exists but fails to import: a real error
                raise
            continue
        for part in m.function.split("."):
            obj = getattr(obj, part, None)
        if inspect.isfunction(obj):
            return obj
    where = ", ".join(m.modules)
    pytest.fail(f"mutant {m.name}: no function {m.function!r} in {where} (moved? update METHOD_MUTANTS)")


def _apply(monkeypatch, fn: Callable, m: Mutant) -> None:
    """Swap ``fn``'s code for its source with ``m.old`` replaced by ``m.new`` (decorators dropped:
    the object they registered is ``fn`` itself, whose code changes)."""
    src = textwrap.dedent(inspect.getsource(fn))
    assert src.count(m.old) == 1, (
        f"mutant {m.name}: {m.old!r} occurs {src.count(m.old)} times in "
        f"{fn.__module__}.{m.function} (changed? update METHOD_MUTANTS)"
    )
    tree = ast.parse(src.replace(m.old, m.new))
    node = tree.body[0]
    assert isinstance(node, ast.FunctionDef) and node.name == fn.__name__, node
    node.decorator_list = []
    ast.increment_lineno(tree, fn.__code__.co_firstlineno - 1)
    scope = dict(vars(inspect.getmodule(fn)))
    exec(compile(tree, inspect.getsourcefile(fn) or "<mutant>", "exec"), scope)
    code = scope[node.name].__code__
    assert code.co_freevars == fn.__code__.co_freevars, f"mutant {m.name}: closures differ"
    monkeypatch.setattr(fn, "__code__", code)


def _param_sets(test: Callable) -> list[dict]:
    """Keyword sets of a test's ``pytest.mark.parametrize`` marks ([{}] when it has none)."""
    sets: list[dict] = [{}]
    for mark in getattr(test, "pytestmark", []):
        if mark.name != "parametrize":
            continue
        names = (
            [n.strip() for n in mark.args[0].split(",")]
            if isinstance(mark.args[0], str)
            else list(mark.args[0])
        )
        values = [v.values if hasattr(v, "values") else v for v in mark.args[1]]
        values = [v if len(names) > 1 else (v,) for v in values]
        sets = [{**s, **dict(zip(names, v))} for s in sets for v in values]
    return sets


def _failure(killer: str, monkeypatch, min_examples: int = 0) -> BaseException | None:
    """Run the test ``killer`` (every parameter set; hypothesis without shrinking, at least
    ``min_examples`` examples); its first failure, or None."""
    mod, _, name = killer.partition(":")
    test = getattr(importlib.import_module(mod), name)
    inner = getattr(test, "_hypothesis_internal_use_settings", None)
    if inner is not None:
        monkeypatch.setattr(
            test,
            "_hypothesis_internal_use_settings",
            settings(
                inner,
                phases=[Phase.explicit, Phase.generate],
                database=None,
                deadline=None,
                max_examples=max(inner.max_examples, min_examples),
            ),
        )
    for kw in _param_sets(test):
        try:
            test(**kw)
        except Exception as e:  # a failing test is the point here
            return e
    return None


@pytest.mark.parametrize("m", METHOD_MUTANTS, ids=lambda m: m.name)
def test_method_mutant_is_caught(monkeypatch, m):
    fn = _resolve(m)
    for k in m.killers:
        err = _failure(k, monkeypatch)
        assert err is None, f"killer {k} fails on the real code, so it proves nothing about {m.name}: {err!r}"
    _apply(monkeypatch, fn, m)
    # more examples than the suite's own run: a search stops at the first failure, so this costs
    # time only when the mutant survives
    caught = {k: _failure(k, monkeypatch, min_examples=100) for k in m.killers}
    assert any(e is not None for e in caught.values()), (
        f"mutant {m.name} ({m.old!r} -> {m.new!r} in {fn.__module__}.{m.function}) survived "
        f"{', '.join(m.killers)}: a missing test"
    )
