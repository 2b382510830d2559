"""Test-wide settings: hypothesis profiles (CI runs the 'ci' profile) and one intra-op thread."""

import os

import torch
from hypothesis import HealthCheck, settings

from megarl.catalogue import load_builtin

torch.set_num_threads(1)

# the composition root of the test session: the built-in method families register their parts
load_builtin()

# deadline=None: the first example pays for thread/process start-up; database=None: no stored
# example replays on some ranks only. 'ci' keeps the suite within its time budget on 2 cores.
settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev",
    max_examples=25,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "deep",
    max_examples=1000,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    """Files holding slow (end-to-end) cases run first. Under pytest-xdist (``-n``, CI's default)
    each file goes to one worker in collection order, so a long file collected last would run
    alone at the end while the other worker idles; started first, the short tests fill the gaps."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: file order kept otherwise
