"""The trainer closes the method's parts at the end of a run: every built part with a ``close()``
(an engine-served teacher's clients and event loop), once, whatever lists it sits in."""

from __future__ import annotations

from megarl.plugin.engine_teacher import EngineTeacherPass
from megarl.trainer.method_runtime import MethodRuntime


class _Client:
    """A teacher engine client: only ``close`` is used here."""

    def __init__(self):
        self.closed = 0

    async def close(self) -> None:
        self.closed += 1


class _Hook:
    """A step hook without resources (no ``close``)."""


def test_close_reaches_every_part_with_close_once():
    client = _Client()
    teacher = EngineTeacherPass([client])
    rt = MethodRuntime(inputs={}, advantages=None)  # type: ignore[arg-type]
    rt.learner_passes.append(teacher)
    rt.step_hooks += [teacher, _Hook()]  # a provider that is also a step hook is listed twice
    loop = teacher.loop
    rt.close()
    assert client.closed == 1
    assert loop.is_closed() and teacher.engines is None
    rt.close()  # a second close is harmless
    assert client.closed == 1


def test_engine_teacher_pass_without_engines_closes_quietly():
    p = EngineTeacherPass(None)
    p.close()
    assert p.loop is None
