"""Method family: the peers' objective catalogue (verl's core_algos), as plugins.

Importing this package registers the policy losses ``gpg``, ``gmpo``, ``clip_cov``, ``kl_cov``,
``bypass_reinforce``, ``dro``, the advantage estimators ``gpg``, ``opo``, ``grpo_passk``, ``remax``,
``kl_reward``, ``otb``, the KL estimators ``abs`` and ``k1_k2grad`` and the round inputs
``remax_baseline`` and ``sum_pi_squared``. Formulas: reference/peers.py; docs:
docs/methods/{gpg,gmpo,clip-cov,kl-cov,bypass,dro,opo,grpo-passk,remax,kl-reward,kl-estimators,otb}.md.
"""

from megarl.methods.peers import bypass, cov, gmpo, gpg, kl_reward, otb, outcome, remax  # noqa: F401
