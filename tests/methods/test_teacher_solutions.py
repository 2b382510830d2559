"""Teacher solutions (RSTG's SFT data): the groups that get them and the solutions kept equal
reference/distillation.py:rstg_nzv / rstg_teacher_solutions; appended solutions carry their
prompt, group, task and answer, a flag, zero rows of the other extras, and reach RSTG's SFT term
exactly when verified on an all-wrong group; the sampler is chosen by the teacher's source and
architecture, and the refused case is named. The end-to-end path (engine sampling, scoring,
broadcast over 2 ranks, both samplers) runs in tests/trainer/test_method_examples.py."""

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference.distillation as rd
from megarl.batch import from_sequences
from megarl.methods.distillation.rstg import SFT, nzv_students, prepare
from megarl.methods.distillation.teacher_solutions import (
    TEACHER_SOLUTION,
    Solutions,
    TeacherArchitectureError,
    TeacherSolutions,
    append_solutions,
    first_of_groups,
    sampler_kind,
    verified,
)
from megarl.plugin.inputs import RolloutInfo
from megarl.plugin.teacher_config import TeacherConfig
from megarl.trainer.method_runtime import AdvantageStage, MethodRuntime

HF = {"model_type": "qwen3", "vocab_size": 40, "hidden_size": 32, "num_hidden_layers": 2, "eos_token_id": 1}


def _batch(rewards, groups):
    B = len(rewards)
    prompts = [[5 + g, 6, 7][: 1 + (i % 3)] for i, g in enumerate(groups)]
    responses = [[10 + i, 11] for i in range(B)]
    b = from_sequences(
        prompts,
        responses,
        groups,
        rewards=torch.tensor(rewards, dtype=torch.float32),
        task_ids=torch.tensor([g % 2 for g in groups]),
        policy_versions=torch.zeros(B, dtype=torch.long),
        truncated=torch.zeros(B, dtype=torch.bool),
        rollout_logprobs=torch.full((sum(len(p) + 2 for p in prompts),), -0.5),
    )
    info = RolloutInfo(
        [f"a{g}" for g in groups],
        {"correct": [float(r > 0.5) for r in rewards]},
        {"row": [[1.0, 2.0]] * B, "x": [0.5] * B},
    )
    b.extras["row"] = torch.tensor(info.extras["row"], dtype=torch.float64)
    b.extras["x"] = torch.tensor(info.extras["x"], dtype=torch.float64)
    return b, info


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_selection_and_verification_match_the_reference(data):
    B = data.draw(st.integers(2, 10))
    groups = data.draw(st.lists(st.integers(0, 3), min_size=B, max_size=B))
    rewards = data.draw(st.lists(st.sampled_from([0.0, 0.3, 1.0]), min_size=B, max_size=B))
    b, _ = _batch(rewards, groups)
    sel = nzv_students(b, 0.5)
    student = torch.ones(B, dtype=torch.bool)
    assert sel.tolist() == rd.rstg_nzv(b.rewards, b.group_ids, student, 0.5).tolist()
    firsts = first_of_groups(b, sel)
    assert sorted(b.group_ids[firsts].tolist()) == sorted(set(b.group_ids[sel].tolist()))
    S = data.draw(st.integers(1, 6))
    sol_groups = torch.tensor(data.draw(st.lists(st.integers(0, 3), min_size=S, max_size=S)))
    sol_rewards = torch.tensor(data.draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=S, max_size=S)))
    ref = rd.rstg_teacher_solutions(b.rewards, b.group_ids, sol_rewards, sol_groups, 0.5)
    # the hook samples only for selected groups, then keeps the verified samples
    mine = torch.zeros(S, dtype=torch.bool)
    kept = verified(sol_rewards, 0.5)
    in_sel = set(b.group_ids[firsts].tolist())
    for k in kept:
        mine[k] = int(sol_groups[k]) in in_sel
    assert mine.tolist() == ref.tolist()


def test_appended_solutions_carry_their_prompt_and_reach_the_sft_term_only_when_verified():
    b, info = _batch([0.0, 0.0, 1.0, 0.0], [0, 0, 1, 1])  # group 0 all wrong, group 1 mixed
    sol = Solutions(
        source=[0, 1, 2],  # two for group 0 (one right, one wrong), one for the mixed group
        responses=[[20, 21, 22], [23], [24, 25]],
        logprobs=[[-0.1, -0.2, 0.3], [-0.4], [-0.5, -0.6]],
        truncated=[False, True, False],
        rewards=[1.0, 0.0, 1.0],
        dims={"correct": [1.0, 0.0, 1.0]},
        sampled=3,
    )
    out, inf = append_solutions(b, info, sol, step=3)
    assert out.num_seqs == 7 and out.group_ids.tolist() == [0, 0, 1, 1, 0, 0, 1]
    cu, pl = out.cu_seqlens.tolist(), out.prompt_lens.tolist()
    for new, src in zip((4, 5, 6), sol.source):
        p = out.tokens[cu[new] : cu[new] + pl[new]].tolist()
        assert (
            p == b.tokens[int(b.cu_seqlens[src]) : int(b.cu_seqlens[src]) + int(b.prompt_lens[src])].tolist()
        )
        assert out.tokens[cu[new] + pl[new] : cu[new + 1]].tolist() == sol.responses[new - 4]
        assert out.loss_mask[cu[new] : cu[new + 1]].tolist() == [0.0] * pl[new] + [1.0] * (
            cu[new + 1] - cu[new] - pl[new]
        )
    assert out.rollout_logprobs[cu[4] + pl[4] : cu[5]].tolist() == pytest.approx([-0.1, -0.2, 0.0])
    assert out.truncated.tolist()[4:] == [False, True, False] and out.policy_versions.tolist()[4:] == [
        2,
        2,
        2,
    ]
    assert out.task_ids.tolist()[4:] == [0, 0, 1]
    assert inf.answers[4:] == ["a0", "a0", "a1"] and inf.reward_dims["correct"][4:] == [1.0, 0.0, 1.0]
    assert inf.extras[TEACHER_SOLUTION] == [0, 0, 0, 0, 1, 1, 1]
    assert inf.extras["row"][4:] == [[0.0, 0.0]] * 3 and inf.extras["x"][4:] == [0.0] * 3
    assert out.extras["row"].shape == (7, 2)
    MethodRuntime.add_round_extras(out, inf)  # what the runtime does after the extenders
    out.teacher_logprobs = torch.full((out.num_tokens,), -1.0)
    out.old_logprobs = torch.full((out.num_tokens,), -1.0)
    out.entropies = torch.ones(out.num_tokens)
    sft = prepare(out, None).extras[SFT]
    assert sft.tolist() == [0, 0, 0, 0, 1, 0, 0]  # verified, on the all-wrong group


def test_the_sampler_follows_the_teacher_and_the_refused_case_is_named():
    def cfg(source="megatron", engine="embedded"):
        return SimpleNamespace(
            sections={"teacher": TeacherConfig(source=source, hf_dir="runs/t")},
            rollout=SimpleNamespace(engine=engine),
        )

    same = {**HF, "eos_token_id": 3, "torch_dtype": "bfloat16"}  # special ids and dtype do not count
    moe = {**HF, "num_experts": 4}
    assert sampler_kind(cfg("engine"), None, HF) == "teacher_engine"
    assert sampler_kind(cfg(), same, HF) == "run_engine"
    assert sampler_kind(cfg(engine="vllm"), same, HF) == "run_engine"
    assert sampler_kind(cfg(), moe, HF) == "embedded"
    with pytest.raises(TeacherArchitectureError, match="num_experts: 4 vs None.*teacher.source: engine"):
        sampler_kind(cfg(engine="vllm"), moe, HF)


def test_teacher_rows_are_checked_and_mapped():
    """``inputs.teacher_logprobs.rows``: the selection, its token positions, and the named errors
    (the passes themselves: tests/methods/test_engine_teacher.py and the RSTG smoke run)."""
    from megarl.plugin.teacher_pass import check_rows, selected_rows, token_index

    b, _ = _batch([0.0, 1.0, 0.0], [0, 1, 2])
    assert selected_rows(b, "") is None
    b.extras["rows"] = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
    assert selected_rows(b, "rows") == [0, 2]
    cu = b.cu_seqlens.tolist()
    assert token_index(b, [0, 2]).tolist() == list(range(cu[0], cu[1])) + list(range(cu[2], cu[3]))
    b.extras["rows"] = torch.zeros(2)
    with pytest.raises(ValueError, match=r"rows='rows': batch.extras\['rows'\] is of shape \(2,\)"):
        selected_rows(b, "rows")
    with pytest.raises(ValueError, match="teacher_topk"):
        check_rows("rows", frozenset({"teacher_logprobs", "teacher_topk"}))
    check_rows("rows", frozenset({"teacher_logprobs"}))


def test_the_runtime_calls_extenders_and_copies_their_extras():
    b, info = _batch([1.0, 0.0], [0, 1])  # the hook selects nothing: no solutions, the flag is 0
    ctx = SimpleNamespace(
        cfg=SimpleNamespace(
            sections={"teacher": TeacherConfig(source="megatron", hf_dir="t")},
            rollout=SimpleNamespace(engine="embedded"),
        ),
        hf_config=HF,
        rank0=False,
    )
    hook = TeacherSolutions(ctx, lambda x: torch.zeros(x.num_seqs, dtype=torch.bool), 2, 0.5, "rstg", HF)
    rt = MethodRuntime(
        inputs={},
        advantages=AdvantageStage(SimpleNamespace(advantage=SimpleNamespace(estimator="grpo", knobs={}))),
    )
    rt.step_hooks.append(hook)
    out, _ = rt.extend_batch(1, b, info)
    assert out is b and out.extras[TEACHER_SOLUTION].tolist() == [0.0, 0.0]
    assert hook.after_step(1, {}) == {
        "rstg/run_engine_swap": 1.0,
        "rstg/selected_groups": 0.0,
        "rstg/teacher_sampled": 0.0,
        "rstg/teacher_verified": 0.0,
    }


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.data())
def test_measured_teacher_accuracy_matches_the_reference(groups, k, data):
    """SKALD's measured accuracy of an external teacher: per group, the fraction of its k samples
    the reward verifies (reference skald_card_accuracy, the same formula as the card-reading one)."""
    from megarl.methods.distillation.teacher_solutions import group_accuracy

    rewards = torch.tensor(
        data.draw(st.lists(st.sampled_from([0.0, 0.4, 1.0]), min_size=groups * k, max_size=groups * k))
    )
    got = group_accuracy([g for g in range(groups) for _ in range(k)], verified(rewards, 0.5))
    want = rd.skald_card_accuracy(rewards.view(groups, k), 0.5)
    assert [got[g] for g in range(groups)] == want.tolist()
