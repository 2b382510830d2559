"""The flow methods on the Megatron flow DiT over real gloo ranks (two spawned processes): LC-GRPO's
and FlowCTS's loss and gradient, each data-parallel replica computing its share through the
methods' own ``share_loss`` (in 1 or 2 micro-batches) and megatron DDP reducing the gradients,
equal reference/flow.py's per-sample loops through its plain-PyTorch DiT on the same (gathered)
weights: TP=1 (DP=2), TP=2, and the Mixture-of-Experts DiT with EP=2 (DP=2, alltoall dispatch).
And both methods' Megatron hooks resume exactly from their sharded checkpoints (MoE, EP=2)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.flow as rf
from megarl.methods.gradients import flow_model as fm
from megarl.testing.gloo_pool import GlooPool

LAYOUTS = {"tp1": ({}, 0), "tp2": ({"tp": 2}, 0), "ep2": ({"ep": 2}, 4)}
DIT = {"hidden": 16, "layers": 2, "heads": 2, "ffn": 32, "topk": 2}
G, GROUPS, STATES = 2, 2, 4


@pytest.fixture(scope="module")
def gloo2():
    pool = GlooPool(2)
    yield pool
    pool.close()


def _learner(layout: dict, experts: int, seed: int):
    from megarl.learner.flow_dit import FlowDiTSpec
    from megarl.learner.flow_learner import FlowLearner
    from megarl.learner.parallel import ParallelLayout, initialize_parallel
    from megarl.methods.gradients.flow_megatron import _distinct_experts

    groups = initialize_parallel(ParallelLayout(**layout))
    ln = FlowLearner(FlowDiTSpec(experts=experts, **DIT), groups, params_dtype=torch.float64, seed=seed)
    if experts:
        _distinct_experts(ln, seed)
    return ln


def loss_case_entry(rank: int, group, payload: tuple) -> dict:
    """GlooPool entry: the method's whole loss, the full weights and the reduced full gradient."""
    from megarl.learner.flow_dit import full_weights
    from megarl.methods.gradients.flowcts import FlowCTSHook, FlowCTSKnobs
    from megarl.methods.gradients.lc_grpo import LCGRPOHook, LCGRPOKnobs, bump_reward, group_advantages

    torch.set_num_threads(1)
    layout, experts, method, seed, opt, micro = payload
    ln = _learner(layout, experts, seed)
    gen = torch.Generator().manual_seed(seed)
    out: dict = {}
    if method == "lc-grpo":
        sampler, a, exact, steps = opt
        k = LCGRPOKnobs(sampler=sampler, a=a, exact=exact, steps=steps, groups=GROUPS, group_size=G)
        hook = LCGRPOHook(k, model=ln)
        noise = torch.randn(G * GROUPS, 2, generator=gen, dtype=torch.float64)
        traj, old, idx = fm.sample(ln, noise, steps, sampler, a, gen, exact)
        old = old + 0.05 * torch.randn(old.shape, generator=gen, dtype=old.dtype)  # off-policy
        adv = group_advantages(bump_reward(traj[-1], k.target, 1.0), G)
        ro = {"traj": traj, "old": old, "idx": idx, "adv": adv}
        parts = ln.micro_batches(ln.dp_share(G * GROUPS), micro)
        loss = ln.backward([lambda c=c: hook.share_loss(ro, c)[0] for c in parts])
        out.update(ro)
    else:
        objective, n, own = opt
        k = FlowCTSKnobs(objective=objective, supervision=n, own_paths=own, through_path=True)
        hook = FlowCTSHook(k, student=ln, reference=_learner(layout, experts, seed + 1))
        x = torch.randn(STATES, 2, generator=gen, dtype=torch.float64)
        t_k = 0.9 * torch.rand(STATES, generator=gen, dtype=torch.float64)
        parts = ln.micro_batches(ln.dp_share(STATES), micro)
        loss = ln.backward([lambda c=c: hook.share_loss(x, t_k, c) for c in parts])
        out.update(x=x, t_k=t_k, reference=full_weights(hook.reference.model, ln.groups))
    out.update(
        loss=ln.all_reduce_dp(loss),
        weights=full_weights(ln.model, ln.groups),
        grads=full_weights(ln.model, ln.groups, grads=True),
    )
    return out


def _velocity(w: dict, experts: int):
    def v(x, t):  # one point [2] at a time, as reference/flow.py calls it
        return rf.dit_velocity(w, x[None], t, patch=1, heads=DIT["heads"], layers=DIT["layers"],
                               freqs=4, experts=experts, topk=DIT["topk"])[0]  # fmt: skip

    return v


def _reference(out: dict, method: str, experts: int, opt: tuple):
    w = {n: t.clone().requires_grad_(True) for n, t in out["weights"].items()}
    v = _velocity(w, experts)
    if method == "lc-grpo":
        sampler, a, exact, steps = opt
        times = fm.time_grid(steps)
        traj = out["traj"]
        new = [
            rf.sde_step_logprobs(v, list(traj[:, i]), times, a, sampler, exact) for i in range(traj.shape[1])
        ]
        loss = rf.grpo_step_loss(new, out["old"].T.tolist(), out["adv"].tolist(), 0.2)
    else:
        objective, n, own = opt
        vr = _velocity(out["reference"], experts)

        def f_s(x, u):
            return -v(x, 1.0 - u)

        def f_r(x, u):
            return -vr(x, 1.0 - u)

        terms = [
            rf.flowcts_loss(f_s, f_r, x, float(t), n, own)
            if objective == "flowcts"
            else rf.kl_opd_loss(f_s, f_r, x, float(t), n, 0.7)
            for x, t in zip(out["x"], out["t_k"])
        ]
        loss = torch.stack(terms).mean()
    names = sorted(w)
    return loss, dict(zip(names, torch.autograd.grad(loss, [w[n] for n in names], allow_unused=True)))


LC_OPTS = st.tuples(
    st.sampled_from(["lc", "flow_grpo"]), st.sampled_from([0.1, 0.7]), st.booleans(), st.sampled_from([3, 4])
)
CTS_OPTS = st.tuples(st.sampled_from(["flowcts", "kl_opd"]), st.integers(1, 3), st.booleans())
CASES = st.one_of(st.tuples(st.just("lc-grpo"), LC_OPTS), st.tuples(st.just("flowcts"), CTS_OPTS))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_loss_and_gradient_equal_the_reference_on_the_same_weights(gloo2, layout):
    lay, experts = LAYOUTS[layout]
    # a MoE's router softmax runs in float32 inside megatron-core: looser there
    tol = {"rtol": 1e-6, "atol": 1e-8} if experts else {"rtol": 1e-9, "atol": 1e-11}

    @settings(max_examples=2, deadline=None, database=None)
    @given(st.integers(0, 2**16), CASES, st.sampled_from([1, 2]))
    def check(seed, case, micro):
        method, opt = case
        outs = gloo2.run(f"{__name__}:loss_case_entry", (lay, experts, method, seed, opt, micro))
        for name, t in outs[0]["weights"].items():  # every rank gathered the same full model
            assert torch.equal(t, outs[1]["weights"][name]), name
        assert outs[0]["loss"] == outs[1]["loss"]
        ref_loss, ref_grads = _reference(outs[0], method, experts, opt)
        torch.testing.assert_close(
            torch.tensor(outs[0]["loss"], dtype=torch.float64), ref_loss.detach(), **tol
        )
        scale = max(float(g.abs().max()) for g in ref_grads.values() if g is not None)
        for name, g in outs[0]["grads"].items():
            want = ref_grads[name] if ref_grads[name] is not None else torch.zeros_like(g)
            torch.testing.assert_close(
                g, want, rtol=tol["rtol"], atol=tol["atol"] * max(1.0, scale), msg=name
            )

    check()


def _resumed_equal(make, folder: Path) -> tuple:
    """A hook's step 2, uninterrupted and resumed (into a hook with other weights) from its sharded
    save after step 1; the resumed hook's update count."""
    import torch.distributed as dist

    hook = make(True)
    hook.after_step(1, {})
    hook.save_sharded(folder)
    state = hook.state_dict()
    resumed = make(False)
    dist.barrier()
    resumed.load_sharded(folder)
    resumed.load_state_dict(state)
    return hook.after_step(2, {}), resumed.after_step(2, {}), resumed.updates


def resume_case_entry(rank: int, group, payload: str) -> list:
    """GlooPool entry: Megatron LC-GRPO and FlowCTS hooks (MoE DiTs, EP=2) resumed from their
    sharded saves redo step 2 as the uninterrupted hooks."""
    from megarl.learner.parallel import ParallelLayout, initialize_parallel
    from megarl.methods.gradients.flowcts import FlowCTSKnobs, ShardedFlowCTSHook
    from megarl.methods.gradients.lc_grpo import LCGRPOKnobs, ShardedLCGRPOHook

    torch.set_num_threads(1)
    ctx = SimpleNamespace(groups=initialize_parallel(ParallelLayout(ep=2)))
    small = {"model": "megatron", "hidden": 16, "heads": 2, "steps": 3, "updates": 1}

    def lc(first: bool):  # the resumed hook is built with other (unpretrained) weights
        hook = ShardedLCGRPOHook(
            LCGRPOKnobs(**small, pretrain_steps=2 if first else 0, groups=2, group_size=2), ctx=ctx
        )
        assert hook.flow.spec.experts == 4  # experts: -1 follows the layout's ep
        return hook

    def cts(first: bool):
        n = 2 if first else 0
        k = FlowCTSKnobs(**small, pretrain_steps=n, reference_pretrain_steps=n, batch=4, supervision=2)
        return ShardedFlowCTSHook(k, ctx=ctx)

    return [_resumed_equal(lc, Path(payload) / "lc"), _resumed_equal(cts, Path(payload) / "cts")]


def test_sharded_checkpoints_resume_exactly(gloo2):
    with tempfile.TemporaryDirectory() as d:
        for rank_result in gloo2.run(f"{__name__}:resume_case_entry", d):
            for straight, resumed, updates in rank_result:
                assert straight == resumed and updates == 2, (straight, resumed)
                assert next(v for k, v in straight.items() if k.endswith("update_norm")) > 0
