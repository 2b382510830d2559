"""Method family: agents (offline and replayed data for agent training), as plugins.

Importing this package registers the policy loss ``regen`` and the advantage estimator ``stored``.
Formulas: reference/agents.py; docs: docs/methods/regen.md.
"""

from megarl.methods.agents import context_teacher, crpo, el, ice, reflectrl, regen, replay, srpo  # noqa: F401
