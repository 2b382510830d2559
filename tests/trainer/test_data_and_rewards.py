"""Bad dataset rows are named by file and line; reward functions that raise or hang are contained."""

import json
import time

import pytest

from megarl.data.dataset import DataError, PromptSampler, load_jsonl_rows
from megarl.data.tasks import generate_task_files
from megarl.data.tokenizer import CharTokenizer
from megarl.rewards.compute import RewardComputer
from megarl.trainer.config import RewardConfig, RewardFunctionConfig


def write(tmp_path, lines, name="d.jsonl"):
    p = tmp_path / name
    p.write_text("".join(line + "\n" for line in lines))
    return p


GOOD = json.dumps({"prompt": "R 12=", "answer": "21"})


@pytest.mark.parametrize(
    "bad, message",
    [
        ("{not json", "d.jsonl:2: not valid JSON"),
        ("[1, 2]", "d.jsonl:2: expected a JSON object, got list"),
        (json.dumps({"answer": "1"}), "d.jsonl:2: field 'prompt' must be a non-empty string, got None"),
        (
            json.dumps({"prompt": "R 1=", "answer": None}),
            "d.jsonl:2: field 'answer' must be a string or number",
        ),
        (
            json.dumps({"prompt": "R x=", "answer": "1"}),
            "d.jsonl:2: prompt cannot be tokenized: character 'x'",
        ),
    ],
)
def test_bad_row_is_named_by_file_and_line(tmp_path, bad, message):
    p = write(tmp_path, [GOOD, bad, GOOD])
    tok = CharTokenizer("0123456789R =")
    with pytest.raises(DataError, match=message):
        load_jsonl_rows(str(p), check_prompt=tok.encode)
    rows, skipped = load_jsonl_rows(str(p), check_prompt=tok.encode, on_bad_row="skip")
    assert len(rows) == 2 and len(skipped) == 1 and skipped[0].startswith(f"{p}:2:")
    assert rows[1].source == f"{p}:3"


def test_too_many_bad_rows_is_fatal_with_list(tmp_path):
    p = write(tmp_path, [GOOD] + ["{"] * 4)
    with pytest.raises(DataError, match="more than data.max_bad_rows=2 bad rows"):
        load_jsonl_rows(str(p), on_bad_row="skip", max_bad_rows=2)


def test_glob_and_missing_files(tmp_path):
    write(tmp_path, [GOOD], "a.jsonl")
    write(tmp_path, [GOOD, GOOD], "b.jsonl")
    rows, _ = load_jsonl_rows(str(tmp_path / "*.jsonl"))
    assert [r.source.rsplit("/", 1)[1] for r in rows] == ["a.jsonl:1", "b.jsonl:1", "b.jsonl:2"]
    with pytest.raises(DataError, match="no file matches"):
        load_jsonl_rows(str(tmp_path / "nope*.jsonl"))


def test_generated_task_files_are_disjoint_and_correct(tmp_path):
    generate_task_files(
        "add", tmp_path / "t.jsonl", tmp_path / "e.jsonl", num_train=50, num_eval=10, digits=2
    )
    tr = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    ev = [json.loads(x) for x in (tmp_path / "e.jsonl").read_text().splitlines()]
    assert len(tr) == 50 and len(ev) == 10 and not {r["prompt"] for r in tr} & {r["prompt"] for r in ev}
    for r in tr:
        a, b = r["prompt"][:-1].split("+")
        assert int(a) + int(b) == int(r["answer"])


def test_sampler_resumes_exactly():
    a = PromptSampler(7, seed=3)
    first = a.next_indices(5)
    st = a.state_dict()
    rest = a.next_indices(12)
    b = PromptSampler(7, seed=3)
    b.load_state_dict(st)
    assert b.next_indices(12) == rest
    assert sorted(first + rest[:2]) == list(range(7))  # an epoch is a permutation


def rc(*fns, timeout_s=5.0, fallback=-1.0):
    return RewardComputer(RewardConfig(functions=list(fns), timeout_s=timeout_s, fallback=fallback))


def test_builtin_rewards_and_weighted_dimensions():
    comp = rc(
        RewardFunctionConfig(name="exact", kind="exact_match", weight=1.0),
        RewardFunctionConfig(name="fmt", kind="regex", pattern="^\\d+$", weight=0.5),
    )
    res = comp(["21", " 21 ", "2x"], ["21", "21", "21"])
    assert res.dims["exact"].tolist() == [1.0, 1.0, 0.0]
    assert res.dims["fmt"].tolist() == [1.0, 0.0, 0.0]
    assert res.scalar.tolist() == [1.5, 1.0, 0.0]


def test_raising_reward_function_is_contained():
    comp = rc(
        RewardFunctionConfig(name="r", kind="python", function="tests.trainer.reward_fns:raises_on_seven")
    )
    try:
        res = comp(["12", "17", "12", "nan"], ["12", "17", "13", "nan"])
        assert res.scalar.tolist() == [1.0, -1.0, 0.0, 1.0]
        assert res.errors == 1 and res.timeouts == 0
        assert "RuntimeError: seven is not allowed" in res.failures[0]
    finally:
        comp.close()


def test_hanging_reward_function_times_out_and_worker_restarts():
    comp = rc(
        RewardFunctionConfig(name="h", kind="python", function="tests.trainer.reward_fns:hangs_on_seven"),
        timeout_s=1.0,
        fallback=0.25,
    )
    try:
        t0 = time.time()
        res = comp(["7", "12", "77", "3"], ["7", "12", "77", "4"])
        took = time.time() - t0
        assert res.scalar.tolist() == [0.25, 1.0, 0.25, 0.0]
        assert res.timeouts == 2 and res.errors == 0
        assert took < 30, took  # two timeouts of 1 s plus worker restarts, not 2 x 60 s
    finally:
        comp.close()


def test_non_finite_reward_is_an_error_and_bad_path_fails_at_start():
    comp = rc(RewardFunctionConfig(name="n", kind="python", function="tests.trainer.reward_fns:returns_nan"))
    try:
        res = comp(["1"], ["1"])
        assert res.errors == 1 and res.scalar.tolist() == [-1.0]
    finally:
        comp.close()
    with pytest.raises(ValueError, match="tests.trainer.reward_fns' has no callable 'missing'"):
        rc(RewardFunctionConfig(name="m", kind="python", function="tests.trainer.reward_fns:missing"))
