"""Method family: agents (offline and replayed data for agent training), as plugins.

Importing this package registers the policy loss ``regen`` and the advantage estimator ``stored``.
Turn credit (TASPO, AgentOPSD: advantage estimators ``taspo``, ``agent_opsd``; TRIAL: the
regulariser ``trial``) with the inputs ``pi_context``/``pi_logprobs`` (a bank of verified successes)
and ``hindsight_context``/``hindsight_logprobs`` (each trajectory's own outcome).
Formulas: reference/agents.py; docs: docs/methods/regen.md, taspo.md, trial.md, agent-opsd.md.
"""

from megarl.methods.agents import (  # noqa: F401
    agent_opsd,
    context_teacher,
    crpo,
    el,
    hindsight,
    ice,
    pi_bank,
    reflectrl,
    regen,
    replay,
    srpo,
    srrl,
    taspo,
    trial,
)
