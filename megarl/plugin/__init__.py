"""The seam between the trainer and every method.

A method is one ``MethodSpec`` (spec.py) registered by name, in-tree (megarl/catalogue.py) or from
the user's own package (``method: {import: "pkg.module:SPEC"}``). It contributes parts through
small typed extension points, each with the built-in behaviour as an ordinary implementation:

- objective parts: advantage estimators, policy losses, regularisers (megarl/registry.py's
  ``Registry`` with a typed ``PartInfo`` per entry), state checkpointed generically;
- batch inputs (inputs.py): a declared name (``entropies``, ``ref_logprobs``, ``steps``, ...)
  filled by one provider, at one stage of the step (learner forward, rollout round, packed batch);
- rollout rounds (rounds.py): rank 0's processors of each round of samples (reward shaping,
  judges, scores made with the run's engines);
- rollout workflows (megarl/rollout/workflow.py): how one prompt becomes trajectories;
- allocation (megarl/trainer/allocation.py): which prompts, how many rounds, which groups stay;
- step hooks (spec.py): around the optimizer steps, with their checkpoint state;
- config sections and keys (config_parts.py): a package's own settings in the run config.

The trainer composes these parts and never names a method.
"""
