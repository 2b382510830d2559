"""The grid game (``environment.name: grid``): board parsing and generation, state transitions and
per-turn rewards, errors as observations, and the per-turn rewards in the trainer's batch (through
the real rollout collector, reward functions and batch builder; the engine is a scripted policy)."""

from __future__ import annotations

import asyncio
import random
import re

import pytest
import torch

from megarl.data.dataset import PromptDataset, PromptRow, PromptSampler
from megarl.data.grid import distances, parse_board, random_board
from megarl.data.tokenizer import CharTokenizer
from megarl.rewards.compute import RewardComputer
from megarl.rollout.environments import run_episode
from megarl.rollout.grid_env import GridGame, GridWorkflow, read_move
from megarl.rollout.types import GenerateResult, Sample, SamplingParams
from megarl.rollout.workflow import WorkflowContext
from megarl.trainer.allocation import allocator_from_config
from megarl.trainer.collector import RolloutCollector
from megarl.trainer.config import from_dict
from megarl.trainer.rollouts import batch_from_json, batch_to_json, build_batch, rollouts_from_groups

ALPHABET = "0123456789,:' ?UDLRabcdefghijklmnopqrstuvwxyz"  # no '(', ')' and '!'
BOARD = "grid 3 at 0,0 goal 2,2 walls 0,1 1,1:"  # the way round: D D R R


def test_boards_are_parsed_and_bad_ones_named():
    assert parse_board(BOARD) == (3, (0, 0), (2, 2), frozenset({(0, 1), (1, 1)}))
    assert parse_board("grid 2 at 0,0 goal 1,1:") == (2, (0, 0), (1, 1), frozenset())
    with pytest.raises(ValueError, match="'R 123=' is not 'grid N at"):
        parse_board("R 123=")
    with pytest.raises(ValueError, match="goal 3,0 is off the board"):
        parse_board("grid 3 at 0,0 goal 3,0:")
    with pytest.raises(ValueError, match="the start or the goal is a wall"):
        parse_board("grid 3 at 0,0 goal 2,2 walls 2,2:")
    assert distances(3, (2, 2), frozenset({(0, 1), (1, 1)}))[(0, 0)] == 4


def test_generated_boards_are_valid_and_solvable():
    rng = random.Random(0)
    for size in (2, 3, 5):
        for _ in range(20):
            prompt, answer = random_board(rng, size)
            n, start, goal, walls = parse_board(prompt)
            assert n == size and len(walls) == size - 1 and start != goal
            assert answer == f"{goal[0]},{goal[1]}" and start in distances(n, goal, walls)


def test_moves_are_read_strictly():
    assert [read_move(t) for t in ("U", " d ", "left", "Right.", "r")] == ["u", "d", "l", "r", "r"]
    assert [read_move(t) for t in ("", "UD", "go up", "7")] == [None] * 4


class ScriptedEngine:
    """Answers turn k of an episode with ``script[seed][k]`` (the episode's sampling seed picks its
    script); every generated token gets logprob -0.5."""

    def __init__(self, tok, scripts: dict[int, list[str]]):
        self.tok, self.scripts, self.max_model_len = tok, scripts, None
        self.turn: dict[int, int] = {}
        self.prompts: list[list[int]] = []

    async def generate(self, prompt_ids, n=1, sampling=None, **_):
        self.prompts.append(list(prompt_ids))
        k = self.turn.get(sampling.seed, 0)
        self.turn[sampling.seed] = k + 1
        ids = self.tok.encode(self.scripts[sampling.seed][k], bos=False)
        return GenerateResult(list(prompt_ids), [Sample(ids, [-0.5] * len(ids), "stop")])


def _play(moves, max_turns=8):
    tok = CharTokenizer(ALPHABET)
    env = GridGame(tok, BOARD, max_turns=max_turns)
    engine = ScriptedEngine(tok, {0: list(moves)})
    ep = asyncio.run(run_episode(engine, env, SamplingParams(seed=0), max_turns=max_turns))
    return tok, env, engine, ep


def test_state_transitions_and_per_turn_rewards():
    moves = ["R", "jump", "D", "U", "D", "D", "R", "R"]
    tok, env, engine, ep = _play(moves)
    obs = [tok.decode(ep.tokens[s:e]) for s, e, r in ep.turn_spans if r == "observation"]
    assert obs == [
        " blocked at 0,0:",  # 0,1 is a wall: the position stays
        " error: 'jump' is not a move U D L R at 0,0:",  # '(' and ')' are not in this alphabet: dropped
        " at 1,0:",
        " at 0,0:",
        " at 1,0:",
        " at 2,0:",
        " at 2,1:",
        " goal",  # '!' is not in the alphabet either
    ]
    assert ep.rewards == pytest.approx([0.0, 0.0, 0.1, -0.1, 0.1, 0.1, 0.1, 1.1])
    assert sum(ep.rewards) == pytest.approx(0.1 * 4 + 1.0)  # shaping telescopes: d_start = 4
    assert env.last_text == "2,2" and env.turn == 8
    # the context of every turn is exactly the previous tokens: sampled ids and observations as they are
    for k, p in enumerate(engine.prompts[1:], start=1):
        assert p == ep.tokens[: len(p)] and len(p) == ep.turn_spans[2 * k][1]
    roles = [r for _, _, r in ep.turn_spans]
    assert roles == ["prompt"] + ["assistant", "observation"] * 8
    for s, e, r in ep.turn_spans:
        assert ep.loss_mask[s:e] == [1.0 if r == "assistant" else 0.0] * (e - s)


def test_the_episode_ends_at_max_turns_off_the_board():
    _, env, _, ep = _play(["L", "up"], max_turns=2)
    assert ep.rewards == [0.0, 0.0] and env.last_text == "0,0" and env.turn == 2


def _scripts(seeds):
    """Even episode j: the shortest way; odd: two malformed turns then off the board."""
    return {s: (["D", "D", "R", "R"] if j % 2 == 0 else ["?", "xx", "L", "L"]) for j, s in enumerate(seeds)}


def test_per_turn_rewards_reach_the_batch_through_the_collector():
    tok = CharTokenizer(ALPHABET)
    cfg = from_dict(
        {
            "model": {"alphabet": ALPHABET, "hf_config": {"model_type": "qwen3"}},
            "data": {"train": "unused.jsonl"},
            "reward": {"functions": [{"name": "reached", "kind": "exact_match", "correct": True}]},
            "environment": {"name": "grid", "max_turns": 4},
            "rollout": {"n": 4},
            "schedule": {"prompts_per_step": 1, "seed": 5},
        }
    )
    base = SamplingParams(max_new_tokens=4, seed=7)
    seeds = [(7 * 31 + j) % (2**31) for j in range(4)]  # EpisodeWorkflow's seed of episode j
    engine = ScriptedEngine(tok, _scripts(seeds))
    ds = PromptDataset([PromptRow(prompt=BOARD, answer="2,2", task="grid", source="mem:0")])
    rewards = RewardComputer(cfg.reward)
    c = RolloutCollector(
        engine=engine,
        tokenizer=tok,
        dataset=ds,
        sampler=PromptSampler(1, 0),
        rewards=rewards,
        workflow=GridWorkflow(WorkflowContext(tok, lambda t, a: (0.0, False), None, cfg.environment)),
        processors=[],
        allocator=allocator_from_config(cfg),
        sampling=lambda step, rnd, i: base,
        n=4,
        weights={"reached": 1.0},
        fallback=0.0,
        version=lambda: 0,
    )
    collected = asyncio.run(c.collect(1))
    collected = batch_from_json(batch_to_json(collected))  # the async loop's checkpoint form keeps them
    batch = build_batch(rollouts_from_groups(collected.groups, ds.task_id, rewards.names, False), 1)
    tr = batch.extras["turn_rewards"]
    assert tr.shape == (4, 4) and tr.dtype == torch.float64
    good, bad = torch.tensor([0.1, 0.1, 0.1, 1.1], dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
    assert torch.allclose(tr[0], good) and torch.allclose(tr[2], good) and torch.equal(tr[1], bad)
    assert batch.rewards.tolist() == [1.0, 0.0, 1.0, 0.0]  # the final cell against the answer (the goal)
    texts = [s.text for s in collected.groups[0].samples]
    assert texts == ["2,2", "0,0", "2,2", "0,0"]
    bad_ep = tok.decode(batch.tokens[int(batch.cu_seqlens[1]) : int(batch.cu_seqlens[2])].tolist())
    assert re.search(r"error: '\?' is not a move.*error: 'xx' is not a move.*blocked at 0,0", bad_ep)
    # only the moves are in the loss: 4 one-character moves per episode plus the 'xx' turn's 2nd character
    assert batch.loss_mask.sum().item() == 4 + 5 + 4 + 5
    assert [len(s) for s in batch.turn_spans] == [9] * 4  # prompt, 4 moves, 4 observations (the last closes)


def test_the_workflow_is_registered_for_the_config():
    from megarl.catalogue import load_builtin
    from megarl.rollout.workflow import WORKFLOWS

    load_builtin()
    assert "grid" in WORKFLOWS.names()


def test_the_example_config_fits_its_episodes_in_the_context(tmp_path):
    """examples/grid-game.yaml: valid, its boards parse, its tokenizer writes every prompt and
    observation, and the longest episode (every turn an error) fits the model's context."""
    from pathlib import Path

    from megarl.trainer.config_checks import validate
    from megarl.trainer.config_loading import load_config
    from megarl.trainer.setup import load_datasets, tokenizer_and_hf_config

    root = Path(__file__).parents[2]
    cfg = load_config(root / "examples" / "grid-game.yaml")
    validate(cfg)
    assert cfg.environment.name == "grid" and cfg.data.generate["task"] == "grid"
    cfg.data.train, cfg.data.eval = str(tmp_path / "train.jsonl"), str(tmp_path / "eval.jsonl")
    tok, hf = tokenizer_and_hf_config(cfg)
    train, ev = load_datasets(cfg, tok, hf)  # generated here: the example's own data.generate
    assert len(train.rows) == cfg.data.generate["num_train"] and ev is not None
    longest = 0
    for row in train.rows + ev.rows:
        g = GridGame(tok, row.prompt, cfg.environment.max_turns)
        ids = g.reset()
        for _ in range(cfg.environment.max_turns):
            ids += tok.encode("?", bos=False) + g.step(tok.encode("?", bos=False)).observation_ids
        assert "not a move (U D L R)" in tok.decode(ids)  # nothing of the error text was dropped
        longest = max(longest, len(ids))
    assert longest <= hf["max_position_embeddings"], longest
