"""Test-wide settings: hypothesis profiles (CI runs the 'ci' profile) and one intra-op thread."""

import os

import torch
from hypothesis import HealthCheck, settings

torch.set_num_threads(1)

# deadline=None: the first example pays for thread/process start-up; database=None: no stored
# example replays on some ranks only. 'ci' keeps the suite within its time budget on 2 cores.
settings.register_profile("ci", max_examples=60, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", max_examples=25, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("deep", max_examples=1000, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
