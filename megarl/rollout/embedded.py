"""The embedded engine: generation in this process with a Hugging Face causal LM.

The default engine when no server is configured (one machine, tests, the CPU quickstart). It runs
its own decode loop over the model's KV cache, so it returns exactly what the servers return:
generated token ids (a matched stop token included), the raw model logprob of each sampled token
(before temperature / top-p), and a finish reason. All in-flight requests decode together in one
padded batch (continuous batching, megarl/rollout/batching.py): a request joins between decode
steps and leaves when its samples are done; each request samples from its own seeded generator.

A ``Decoder`` installed with ``install_decoder`` replaces that decode loop (e.g. speculative
decoding) and serves requests one at a time: it gets the validated request, the request's seeded
generator and the stop ids, and returns the samples in the same form (every logprob the model's
own, before temperature / top-p).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from megarl.rollout.batching import BatchScheduler, Job
from megarl.rollout.engine import RolloutEngine
from megarl.rollout.kv_batch import output_cache
from megarl.rollout.sampling import filter_logits as _filter_logits
from megarl.rollout.types import EngineDeadError, GenerateRequest, GenerateResult, Sample
from megarl.rollout.weights import check_weights_dir

__all__ = ["Decoder", "EmbeddedEngine", "_filter_logits", "fuse_expert_tensors", "teacher_forced_logprobs"]


_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def fuse_expert_tensors(state: dict[str, torch.Tensor], model_keys: set[str]) -> dict[str, torch.Tensor]:
    """Per-expert HF tensors (``<p>.experts.<e>.{gate,up,down}_proj.weight``, the checkpoint format
    megarl exports) -> the fused ``<p>.experts.gate_up_proj`` [E, 2I, H] (gate rows, then up rows)
    and ``<p>.experts.down_proj`` [E, H, I] of models that store experts fused (transformers >= 5
    Qwen3-MoE). Tensors of models without fused experts, and all other tensors, pass unchanged."""
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for k, v in state.items():
        m = _EXPERT.match(k)
        if m and f"{m.group(1)}.gate_up_proj" in model_keys:
            parts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = v
        else:
            out[k] = v
    for prefix, d in parts.items():
        E = 1 + max(e for e, _ in d)
        missing = [
            f"{prefix}.{e}.{w}_proj.weight"
            for e in range(E)
            for w in ("gate", "up", "down")
            if (e, w) not in d
        ]
        if missing:
            raise ValueError(f"expert tensors {missing[:3]} are missing (fused experts need all of them)")
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([d[(e, "gate")], d[(e, "up")]], 0) for e in range(E)]
        )
        out[f"{prefix}.down_proj"] = torch.stack([d[(e, "down")] for e in range(E)])
    return out


@torch.no_grad()
def teacher_forced_logprobs(
    model: torch.nn.Module, prompt_ids: Sequence[int], response_ids: Sequence[int]
) -> torch.Tensor:
    """log p(response[i] | prompt, response[:i]) under ``model`` in fp32 arithmetic: [R] float32.

    This is how the learner recomputes the logprobs of rollout tokens (teacher forcing).
    """
    ids = torch.tensor([list(prompt_ids) + list(response_ids)], dtype=torch.long)
    logits = model(input_ids=ids).logits[0].float()  # [P+R, V]
    P, R = len(prompt_ids), len(response_ids)
    logp = torch.log_softmax(logits[P - 1 : P + R - 1], dim=-1)  # rows that scored the response tokens
    return logp.gather(-1, torch.tensor(response_ids).unsqueeze(-1)).squeeze(-1)


@runtime_checkable
class Decoder(Protocol):
    """A decode loop for the embedded engine; runs in its worker thread with the model locked."""

    def decode(
        self,
        engine: EmbeddedEngine,
        req: GenerateRequest,
        gen: torch.Generator,
        stop_ids: set[int],
        abort: threading.Event,
    ) -> list[Sample]: ...


class EmbeddedEngine(RolloutEngine):
    """``RolloutEngine`` over an in-process HF causal LM.

    Args:
      model: a ``transformers`` causal LM (eval mode is set here).
      eos_token_ids: ids that end a sample unless ``ignore_eos`` (default: the model config's).
      tokenizer: needed only for stop strings (``decode`` of the generated ids).
      max_batch_rows: samples decoding in one batch at most (requests beyond wait for rows).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        name: str = "embedded",
        tokenizer: Any = None,
        eos_token_ids: Sequence[int] | None = None,
        max_model_len: int | None = None,
        max_concurrency: int = 64,
        weight_version: str = "0",
        max_batch_rows: int = 1024,
    ):
        cfg = model.config
        super().__init__(
            name,
            max_concurrency=max_concurrency,
            vocab_size=int(cfg.vocab_size),
            max_model_len=max_model_len or int(getattr(cfg, "max_position_embeddings", 0)) or None,
            weight_version=weight_version,
        )
        self.model = model.eval()
        self.tokenizer = tokenizer
        if eos_token_ids is None:
            eos = getattr(cfg, "eos_token_id", None)
            eos_token_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.eos_token_ids = list(eos_token_ids)
        # One user of the model at a time: a batch step, a scoring call, a weight load. Weight loads
        # and decoder swaps raise ``_draining``: no request joins until the batch is empty.
        self._lock = threading.Condition()
        self._draining = 0
        self._abort_flags: dict[str, threading.Event] = {}
        self.dead_reason: str | None = None
        self._cache_arg: str | None = None
        self.decoder: Decoder | None = None  # None: the batched decode loop
        self._batcher = BatchScheduler(self, max_batch_rows)

    @classmethod
    def from_pretrained(
        cls, model_dir: str | os.PathLike, dtype: torch.dtype = torch.float32, **kw: Any
    ) -> EmbeddedEngine:
        """Load a HF checkpoint directory (and its tokenizer, when present) into an engine."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        if "tokenizer" not in kw and (Path(model_dir) / "tokenizer.json").exists():
            from transformers import AutoTokenizer

            kw["tokenizer"] = AutoTokenizer.from_pretrained(model_dir)
        return cls(model, **kw)

    # ----------------------------------------------------------------------------- generation
    async def _generate(self, req: GenerateRequest) -> GenerateResult:
        if self.dead_reason is not None:
            raise EngineDeadError(f"{self.name}: engine is down ({self.dead_reason})")
        flag = self._abort_flags.setdefault(req.request_id, threading.Event())
        job = Job(req=req, abort=flag)
        try:
            self._batcher.submit(job, asyncio.get_running_loop())
            samples = await asyncio.wrap_future(job.future)
        finally:
            self._abort_flags.pop(req.request_id, None)
        return GenerateResult(
            prompt_ids=list(req.prompt_ids), samples=samples, engine=self.name, request_id=req.request_id
        )

    async def _score(self, ids: list[int], top_k: int):
        if self.dead_reason is not None:
            raise EngineDeadError(f"{self.name}: engine is down ({self.dead_reason})")
        return await asyncio.to_thread(self._score_sync, ids, top_k)

    @torch.no_grad()
    def _score_sync(self, ids: list[int], top_k: int):
        from megarl.rollout.scoring import TokenScores

        with self._batcher.hold():
            logits = self.model(input_ids=torch.tensor([ids], dtype=torch.long)).logits[0, :-1].float()
        logp = torch.log_softmax(logits, dim=-1)  # row i scores ids[i + 1]
        lp = logp.gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)
        out = TokenScores(logprobs=[0.0, *lp.tolist()])
        if top_k:
            v, i = logp.topk(min(top_k, logp.shape[-1]), dim=-1)
            out.top_ids, out.top_logprobs = [[], *i.tolist()], [[], *v.tolist()]
        return out

    def decode_alone(
        self, req: GenerateRequest, gen: torch.Generator, abort: threading.Event
    ) -> list[Sample]:
        """Serve ``req`` with the installed decoder (called by the batch loop with the model locked)."""
        sp = req.sampling
        stop_ids = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(self.eos_token_ids))
        assert self.decoder is not None
        return self.decoder.decode(self, req, gen, stop_ids, abort)

    def stop_hit(self, tokens: list[int], stop_ids: set[int], sp: Any) -> tuple[Any] | None:
        """``(stop_reason,)`` when the sample ``tokens`` ends with a stop (its last token is a stop
        id: the id when it is one of ``sp.stop_token_ids``, else None; or its text holds a stop
        string: the string), None while it goes on."""
        t = tokens[-1]
        if t in stop_ids:
            return (t if t in sp.stop_token_ids else None,)
        if sp.stop_strings and self.tokenizer is not None:
            text = self.tokenizer.decode(tokens)
            hit = next((s for s in sp.stop_strings if s in text), None)
            if hit is not None:
                return (hit,)
        return None

    def install_decoder(self, decoder: Decoder | None) -> Decoder | None:
        """Replace the decode loop with ``decoder`` (None: the batched loop) once the running
        requests are done; returns the one it replaces."""
        with self._drained():
            old, self.decoder = self.decoder, decoder
        return old

    @contextlib.contextmanager
    def _drained(self):
        """Hold the model with no request decoding: admissions stop, the batch finishes, then the
        body runs; requests that arrived meanwhile start after it."""
        with self._batcher.hold():
            self._draining += 1
            try:
                self._lock.wait_for(lambda: not self._batcher.busy)
                yield
            finally:
                self._draining -= 1
                self._batcher.kick()
                self._lock.notify_all()

    def _cache_arg_name(self) -> str:
        # transformers >= 5.2x names the KV cache ``cache``; older releases ``past_key_values``.
        if self._cache_arg is None:
            import inspect

            params = inspect.signature(self.model.forward).parameters
            self._cache_arg = "cache" if "cache" in params else "past_key_values"
        return self._cache_arg

    def _cache_kw(self, out: Any) -> dict:
        return {self._cache_arg_name(): output_cache(out)}

    # ----------------------------------------------------------------------------- control
    async def abort(self, request_id: str | None = None) -> int:
        """Stop decoding the request(s); callers get the tokens so far with finish_reason "abort"."""
        ids = [request_id] if request_id is not None else list(self._abort_flags)
        count = 0
        for rid in ids:
            flag = self._abort_flags.get(rid)
            if flag is not None:
                flag.set()
                count += 1
        return count

    async def update_weights(self, weights_dir: str | os.PathLike, version: str | None = None) -> None:
        """Load a HF safetensors checkpoint into the model (once the decoding requests finish; none
        joins meanwhile)."""
        from safetensors.torch import load_file

        names = set(self.model.state_dict().keys())
        found = (
            set(fuse_expert_tensors({k: torch.empty(0) for k in check_weights_dir(weights_dir)}, names))
            if any(k.endswith("experts.gate_up_proj") for k in names)
            else check_weights_dir(weights_dir)
        )
        missing = sorted(names - found)
        if missing:
            from megarl.rollout.types import WeightsDirError

            raise WeightsDirError(f"{weights_dir}: tensors {missing[:5]} of the model are missing")
        state: dict[str, torch.Tensor] = {}
        for f in sorted(Path(weights_dir).glob("*.safetensors")):
            state.update(load_file(str(f)))
        await self.update_weights_from_tensors(state, version)

    async def update_weights_from_tensors(
        self, state: dict[str, torch.Tensor], version: str | None = None
    ) -> None:
        """Copy in-memory tensors (HF names; per-expert MoE tensors are fused for models that store
        experts fused) into the model; shapes must match."""

        def load() -> None:
            with self._drained():
                own = self.model.state_dict()
                fused = fuse_expert_tensors(state, set(own))
                for k, v in fused.items():
                    if k not in own:
                        continue
                    if own[k].shape != v.shape:
                        raise ValueError(
                            f"{self.name}: tensor {k} has shape {tuple(v.shape)}, "
                            f"model expects {tuple(own[k].shape)}"
                        )
                    own[k].copy_(v)
                if version is not None:
                    self.weight_version = version

        await asyncio.to_thread(load)

    async def health(self) -> bool:
        return self.dead_reason is None

    def shutdown(self, reason: str = "shut down", wait: float | None = None) -> None:
        """Stop serving: in-flight requests fail at their next decode step, later ones at once.
        With ``wait``, block up to that many seconds until the worker thread has stopped (a daemon
        thread still inside the model when the interpreter exits aborts the process)."""
        self.dead_reason = reason
        self._batcher.kick()
        if wait is not None:
            self._batcher.join(wait)


def hf_model_from_config(hf_config: dict) -> torch.nn.Module:
    """A transformers causal LM with the architecture of ``hf_config`` (random weights: the learner
    syncs its own into it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = {
        k: v for k, v in hf_config.items() if k not in ("model_type", "architectures", "transformers_version")
    }
    config = AutoConfig.for_model(hf_config["model_type"], **kw)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
